# shellcheck shell=bash
# Sourced by scripts/train_torchrun.sh, scripts/train_slurm.sbatch and scripts/baselines.sh:
# the model shapes of the paper's evaluation, the default layout of each schedule, and the
# training flags every launcher shares. Everything is set through environment variables.
#
# MODEL (shapes; sequence length 512 as in the paper's Section 5; parameters counted by
# megatron_2bw.planner.ModelSpec.num_parameters() with GPT-2's 50257-token vocabulary for GPT
# and BERT's 30522 for BERT, embeddings tied):
#   gpt-1.3b   24 layers, hidden 2048, 16 heads   1.31e9  GPT-3 "XL" shape (Brown et al. 2020,
#                                                         Table 2.1) with Megatron's 128-wide heads
#   gpt-2.2b   32 layers, hidden 2304, 24 heads   2.16e9  \ hidden 2304 / 24 heads is the width of
#   bert-2.2b  32 layers, hidden 2304, 24 heads   2.12e9  / Megatron-LM's 4.2B GPT-2 (Shoeybi et al.
#                                                           2019, Table 1: 96 per head), 32 layers
#   gpt-3.9b   48 layers, hidden 2560, 40 heads   3.91e9  \ Megatron-LM's 3.9B BERT shape (Shoeybi
#   bert-3.8b  48 layers, hidden 2560, 40 heads   3.87e9  / et al. 2019, Table 4); BERT's smaller
#                                                           vocabulary gives 3.8B
#   gpt-tiny / bert-tiny   4 layers, hidden 256, 4 heads, sequence 128 (smoke runs, CPU=1)
# The paper (PipeDream-2BW, Narayanan et al. 2021) names the models by parameter count
# (GPT 1.3B/2.2B/3.9B, BERT 2.2B/3.8B, sequence length 512); the shapes above are the
# Megatron-standard ones that give those counts.
#
# SCHEDULE (--pipeline-schedule) and its default layout on NODES x GPUS_PER_NODE devices:
#   megatron   Megatron tensor MP: TP = GPUS_PER_NODE (at most 8), PP = 1, DP over the nodes
#   naive      inter-layer MP without pipelining: TP = 1, PP = GPUS_PER_NODE
#   gpipe      GPipe: TP = 1, PP = GPUS_PER_NODE
#   flush      PipeDream-Flush: TP = 1, PP = GPUS_PER_NODE
#   2bw        PipeDream-2BW: TP = 1, PP = GPUS_PER_NODE
#   pipedream  PipeDream-1F1B with weight stashing: TP = 1, PP = GPUS_PER_NODE
# TP and PP override; DP = NODES x GPUS_PER_NODE / (TP x PP).
#
# Other variables (defaults in brackets): MICRO_BATCH [2], GLOBAL_BATCH [512], SEQ_LENGTH [512],
# TRAIN_ITERS [1000], LR [GPT 1.5e-4, BERT 1e-4], MIN_LR [1e-5], WARMUP_ITERS [10],
# CLIP_GRAD [1.0], UNTIE=1 (--untie-embeddings-and-output-weights), PRECISION [fp16: the
# paper's V100s; bf16 on A100/H100; fp32], RECOMPUTE=1 (full activation recomputation),
# LOG_INTERVAL [10], EVAL_INTERVAL [500], EVAL_ITERS [10], SAVE, LOAD, SAVE_INTERVAL,
# DATA_PATH + TOKENIZER_MODEL (+ TOKENIZER_TYPE) or MOCK_DATA=1 (random tokens, VOCAB_SIZE),
# CPU=1 (gloo on CPU processes), DRY_RUN=1 (print the command, run nothing). NNODES is read as
# NODES where NODES is unset.

REPO="${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"

die() {
    echo "error: $*" >&2
    exit 2
}

# model_shape MODEL -> sets KIND, NUM_LAYERS, HIDDEN, HEADS, DEFAULT_SEQ, DEFAULT_VOCAB
model_shape() {
    case "$1" in
        gpt-1.3b)  KIND=gpt;  NUM_LAYERS=24; HIDDEN=2048; HEADS=16; DEFAULT_SEQ=512 ;;
        gpt-2.2b)  KIND=gpt;  NUM_LAYERS=32; HIDDEN=2304; HEADS=24; DEFAULT_SEQ=512 ;;
        gpt-3.9b)  KIND=gpt;  NUM_LAYERS=48; HIDDEN=2560; HEADS=40; DEFAULT_SEQ=512 ;;
        bert-2.2b) KIND=bert; NUM_LAYERS=32; HIDDEN=2304; HEADS=24; DEFAULT_SEQ=512 ;;
        bert-3.8b) KIND=bert; NUM_LAYERS=48; HIDDEN=2560; HEADS=40; DEFAULT_SEQ=512 ;;
        gpt-tiny)  KIND=gpt;  NUM_LAYERS=4;  HIDDEN=256;  HEADS=4;  DEFAULT_SEQ=128 ;;
        bert-tiny) KIND=bert; NUM_LAYERS=4;  HIDDEN=256;  HEADS=4;  DEFAULT_SEQ=128 ;;
        *) die "MODEL=$1: choose gpt-1.3b, gpt-2.2b, gpt-3.9b, bert-2.2b, bert-3.8b," \
               "gpt-tiny or bert-tiny" ;;
    esac
    if [[ $KIND == gpt ]]; then DEFAULT_VOCAB=50257; else DEFAULT_VOCAB=30522; fi
}

# schedule_layout SCHEDULE -> sets TP and PP (unless given) for NODES x GPUS_PER_NODE
schedule_layout() {
    local per_node="$GPUS_PER_NODE"
    case "$1" in
        megatron)
            (( per_node > 8 )) && per_node=8
            TP="${TP:-$per_node}"; PP="${PP:-1}" ;;
        naive|gpipe|flush|2bw|pipedream)
            TP="${TP:-1}"; PP="${PP:-$per_node}" ;;
        *) die "SCHEDULE=$1: choose megatron, naive, gpipe, flush, 2bw or pipedream" ;;
    esac
}

# training_args -> fills the array TRAIN_ARGS and sets ENTRY (the pretrain script)
training_args() {
    MODEL="${MODEL:-gpt-2.2b}"
    SCHEDULE="${SCHEDULE:-2bw}"
    NODES="${NODES:-${NNODES:-1}}"
    GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
    model_shape "$MODEL"
    schedule_layout "$SCHEDULE"
    ENTRY="$REPO/pretrain_${KIND}_2bw.py"
    local seq="${SEQ_LENGTH:-$DEFAULT_SEQ}" lr_default=1.5e-4
    [[ $KIND == bert ]] && lr_default=1e-4
    TRAIN_ARGS=(
        --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
        --seq-length "$seq" --max-position-embeddings "$seq"
        --pipeline-schedule "$SCHEDULE"
        --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
        --micro-batch-size "${MICRO_BATCH:-2}" --global-batch-size "${GLOBAL_BATCH:-512}"
        --train-iters "${TRAIN_ITERS:-1000}"
        --lr "${LR:-$lr_default}" --min-lr "${MIN_LR:-1e-5}" --lr-decay-style cosine
        --lr-warmup-iters "${WARMUP_ITERS:-10}" --weight-decay 0.01
        --clip-grad "${CLIP_GRAD:-1.0}"
        --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-500}"
        --eval-iters "${EVAL_ITERS:-10}"
        --seed "${SEED:-1234}"
    )
    case "${PRECISION:-fp16}" in
        fp16) TRAIN_ARGS+=(--fp16) ;;
        bf16) TRAIN_ARGS+=(--bf16) ;;
        fp32) ;;
        *) die "PRECISION=$PRECISION: choose fp16, bf16 or fp32" ;;
    esac
    [[ ${UNTIE:-0} == 1 ]] && TRAIN_ARGS+=(--untie-embeddings-and-output-weights)
    [[ ${RECOMPUTE:-0} == 1 ]] &&
        TRAIN_ARGS+=(--recompute-granularity full --recompute-method uniform)
    [[ ${CPU:-0} == 1 ]] && TRAIN_ARGS+=(--cpu)
    if [[ ${MOCK_DATA:-0} == 1 ]]; then
        TRAIN_ARGS+=(--mock-data --vocab-size "${VOCAB_SIZE:-$DEFAULT_VOCAB}")
    else
        [[ -n ${DATA_PATH:-} && -n ${TOKENIZER_MODEL:-} ]] || die "set DATA_PATH and" \
            "TOKENIZER_MODEL (python -m megatron_2bw.data.default prints those of the embedded" \
            "corpus; BERT takes the sentence-level one), or MOCK_DATA=1"
        # shellcheck disable=SC2206  # DATA_PATH may be a blend "w1 prefix1 w2 prefix2"
        TRAIN_ARGS+=(--data-path $DATA_PATH --tokenizer-model "$TOKENIZER_MODEL")
        [[ -n ${TOKENIZER_TYPE:-} ]] && TRAIN_ARGS+=(--tokenizer-type "$TOKENIZER_TYPE")
    fi
    [[ -n ${SAVE:-} ]] && TRAIN_ARGS+=(--save "$SAVE" --save-interval "${SAVE_INTERVAL:-1000}")
    [[ -n ${LOAD:-} ]] && TRAIN_ARGS+=(--load "$LOAD")
    return 0
}

# run_or_print COMMAND... -> prints the command (shell-quoted), runs it unless DRY_RUN=1
run_or_print() {
    local line
    line="$(printf '%q ' "$@")"
    echo "+ ${line% }"
    [[ ${DRY_RUN:-0} == 1 ]] && return 0
    "$@"
}

# The repository's virtualenv launcher when there is one, else torchrun from PATH.
default_torchrun() {
    if [[ -x "$REPO/.venv/bin/torchrun" ]]; then
        echo "$REPO/.venv/bin/torchrun"
    else
        echo torchrun
    fi
}
