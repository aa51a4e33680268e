#!/bin/bash
# 2BW's recommended setting on a production-like layout, one node (torchrun):
#     bash scripts/train_recommended.sh CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [more flags]
#     MOE=1 bash scripts/train_recommended.sh ...     # the Mixture-of-Experts variant
# TP=2 x PP=2 x DP=2 on 8 processes (CPU processes over gloo where there is no CUDA device),
# bf16, Muon with its state sharded over the data-parallel ranks (--optimizer dist_muon) and
# 2BW's `ef` correction, a Llama-style model (RMSNorm, SwiGLU, RoPE, grouped-query attention,
# no biases) with sequence parallelism (on GPUs; ignored with a note on the CPU). MOE=1 makes
# every FFN 4 experts, top-2, at TP=1 x PP=2 x EP=2 x DP=4 (MoE with TP > 1 needs sequence
# parallelism, which the CPU lacks; on GPUs set TP).
# The sizes are small so that it runs as written on a laptop's CPU; for a real model append
# its shape (--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
# --num-attention-heads 32 --num-query-groups 8 --seq-length 4096 ...) and batch: flags after
# DATA_PATH are appended and override. TOKENIZER_MODEL is a sentencepiece model, DATA_PATH its
# indexed dataset (`python -m megatron_2bw.data.default` builds both and prints their paths).
# GPUS_PER_NODE, TP, PP, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT set the launch.
# Why these flags: README "Recommended flags for production", docs/convergence.md.
set -euo pipefail

if (( $# < 3 )); then
    echo "usage: bash $0 CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [more flags]" >&2
    exit 2
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECKPOINT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3

DISTRIBUTED_ARGS=(
    --nproc-per-node "${GPUS_PER_NODE:-8}"
    --nnodes "${NNODES:-1}"
    --node-rank "${NODE_RANK:-0}"
    --master-addr "${MASTER_ADDR:-localhost}"
    --master-port "${MASTER_PORT:-6000}"
)

MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 176
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --seq-length 32
    --max-position-embeddings 32
    --normalization RMSNorm
    --swiglu
    --position-embedding-type rope
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MOE_ARGS=()
TP_DEFAULT=2
if [[ ${MOE:-0} == 1 ]]; then
    TP_DEFAULT=1
    MOE_ARGS=(
        --num-experts 4
        --moe-router-topk 2
        --moe-router-load-balancing-type aux_loss
        --moe-aux-loss-coeff 1e-2
        --moe-token-dispatcher-type alltoall
        --expert-model-parallel-size 2
    )
fi

TRAINING_ARGS=(
    --pipeline-schedule 2bw
    --optimizer dist_muon
    --stale-weight-correction ef
    --bf16
    --micro-batch-size 1
    --global-batch-size 8
    --train-iters 8
    --lr 1e-3
    --min-lr 1e-4
    --lr-decay-style cosine
    --lr-warmup-iters 1
    --weight-decay 0.1
    --clip-grad 1.0
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-$TP_DEFAULT}"
    --pipeline-model-parallel-size "${PP:-2}"
    --sequence-parallel
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
    --data-path "$DATA_PATH"
    --split "949,50,1"
)

LOGGING_ARGS=(
    --log-interval 1
    --log-throughput
    --save-interval 8
    --eval-interval 8
    --eval-iters 1
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$CHECKPOINT_PATH/tensorboard"
)

TORCHRUN="torchrun"
[[ -x "$REPO/.venv/bin/torchrun" ]] && ! command -v torchrun >/dev/null && \
    TORCHRUN="$REPO/.venv/bin/torchrun"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$TORCHRUN" "${DISTRIBUTED_ARGS[@]}" "$REPO/pretrain_gpt_2bw.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "${@:4}"
