#!/bin/bash

# megatron-2bw: Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (core_v0.16.1),
# shrunk only in sizes and paths, for 1 node x 4 processes (CPU processes where there is no
# CUDA: the runtime picks gloo by itself), pipeline 2 x expert parallel 2:
#     bash scripts/examples/train_mixtral_8x7b_distributed.sh CHECKPOINT_PATH TOKENIZER_MODEL \
#         DATA_PATH [more flags]
#     bash scripts/examples/train_mixtral_8x7b_distributed.sh ckpt \
#         data/cache/default/tokenizer.model data/cache/default/stdlib_text_document
# (TOKENIZER_MODEL a sentencepiece model, DATA_PATH its indexed dataset: `python -m
# megatron_2bw.data.default` builds both and prints their paths.)
# Changed against the original (everything else is as there):
#   GPUS_PER_NODE          8 -> 4
#   arguments after $3 are appended to the training flags (they override)
#   --seq-length           4096 -> 32, --max-position-embeddings 32768 -> 32
#   --num-layers           32 -> 4
#   --hidden-size          4096 -> 64
#   --ffn-hidden-size      14336 -> 224
#   --num-attention-heads  32 -> 8, --num-query-groups 8 -> 2
#   --global-batch-size    256 -> 8
#   --train-iters          500000 -> 8, --lr-decay-iters 320000 -> 8, --lr-warmup-iters 500 -> 1
#   --pipeline-model-parallel-size 4 -> 2, --expert-model-parallel-size 8 -> 2
#   --save-interval 10000 -> 8, --eval-interval 1000 -> 8, --eval-iters 10 -> 1
#   pretrain_gpt.py -> pretrain_gpt_2bw.py, plus --pipeline-schedule ${SCHEDULE:-2bw}
#   the script exits with torchrun's exit code
# (--num-experts 8, top-2 routing, the aux loss and the alltoall dispatcher are the original's;
# on the CPU --moe-grouped-gemm is a note: megatron-core's SequentialMLP runs the experts.)

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=4
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"6000"}
NNODES=${SLURM_NNODES:-"1"}
NODE_RANK=${RANK:-"0"}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))

CHECKPOINT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 32
    --max-position-embeddings 32
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 8
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split 99990,8,2
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8
    --lr 1e-4
    --train-iters 8
    --lr-decay-iters 8
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 1
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
    --pipeline-schedule ${SCHEDULE:-2bw}
    --expert-model-parallel-size 2
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1 \
    --save-interval 8 \
    --eval-interval 8 \
    --eval-iters 1 \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" \
    --no-load-optim \
    --no-load-rng
)

if [ -n "${WANDB_API_KEY}" ]; then
    LOGGING_ARGS+=(
        --wandb-project ${WANDB_PROJECT:-"Mixtral"}
        --wandb-exp-name ${WANDB_NAME:-"Mixtral_8x7B"}
    )
fi


torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt_2bw.py \
    ${MODEL_ARGS[@]} \
    ${MOE_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${LOGGING_ARGS[@]} \
    "${@:4}"
exit $?
