#!/bin/bash

# Runs the "175B" parameter model

# megatron-2bw: Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (core_v0.16.1),
# shrunk only in sizes and paths, for 1 node x 2 processes (CPU processes where there is no
# CUDA: the runtime picks gloo by itself). Build the data first:
#     python scripts/examples/prepare_data.py            # into data/cache/examples
#     bash scripts/examples/train_gpt3_175b_distributed.sh [CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#         VOCAB_FILE MERGE_FILE DATA_PATH]
# The hyperparameters are the 175B model's: at --lr 6e-5, and with fp16's first ~20 steps
# skipped while the loss scale falls from 2^32, 8 iterations barely move the loss.
# Changed against the original (everything else is as there):
#   GPUS_PER_NODE          8 -> 2
#   MASTER_PORT            6000 -> ${MASTER_PORT:-6000}
#   $1..$5                 each falls back to an env var of the same name, then to a local
#                          default (checkpoints/, runs/, data/cache/examples/); arguments
#                          after $5 are appended to the training flags (they override: the
#                          tests raise --lr and lower --initial-loss-scale, see below)
#   --num-layers           96 -> 4
#   --hidden-size          12288 -> 64
#   --num-attention-heads  96 -> 4
#   --seq-length, --max-position-embeddings   2048 -> 32
#   --micro-batch-size     1 (kept)
#   --global-batch-size    1536 -> 8
#   --rampup-batch-size    16 16 5859375 -> 4 2 16
#   --train-iters 500000 -> --train-samples 52 (4 ramp-up iterations of 4, 4, 6, 6 samples,
#                          then 4 of 8: 8 iterations); --lr-decay-iters 430000 ->
#                          --lr-decay-samples 45 (the same 86% of training). Megatron-LM's
#                          validate_args refuses the original's --rampup-batch-size with
#                          --train-iters ("expected no batch-size rampup for iteration-based
#                          training", megatron/training/arguments.py:765 at core_v0.16.1), so
#                          it trains by samples here
#   --tensor-model-parallel-size    8 -> 1
#   --pipeline-model-parallel-size  16 -> 2
#   --log-interval 100 -> 1, --save-interval 10000 -> 8, --eval-interval 1000 -> 8,
#   --eval-iters 10 -> 1
#   pretrain_gpt.py -> pretrain_gpt_2bw.py, plus --pipeline-schedule ${SCHEDULE:-2bw}

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=2
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

EXAMPLES_DATA=data/cache/examples
CHECKPOINT_PATH=${1:-${CHECKPOINT_PATH:-checkpoints/gpt3_175b_shrunk}} #<Specify path>
TENSORBOARD_LOGS_PATH=${2:-${TENSORBOARD_LOGS_PATH:-runs/tensorboard/gpt3_175b_shrunk}} #<Specify path>
VOCAB_FILE=${3:-${VOCAB_FILE:-$EXAMPLES_DATA/gpt2-vocab.json}} #<Specify path to file>/gpt2-vocab.json
MERGE_FILE=${4:-${MERGE_FILE:-$EXAMPLES_DATA/gpt2-merges.txt}} #<Specify path to file>/gpt2-merges.txt
DATA_PATH=${5:-${DATA_PATH:-$EXAMPLES_DATA/gpt3/my-gpt3_text_document}} #<Specify path and file prefix>_text_document

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE 
    --nnodes $NUM_NODES 
    --master_addr $MASTER_ADDR 
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 4 
    --hidden-size 64 
    --num-attention-heads 4 
    --seq-length 32 
    --max-position-embeddings 32 
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 1 
    --global-batch-size 8 
    --rampup-batch-size 4 2 16 
    --train-samples 52 
    --weight-decay 0.1 
    --adam-beta1 0.9 
    --adam-beta2 0.95 
    --init-method-std 0.006 
    --clip-grad 1.0 
    --fp16
    --lr 6.0e-5 
    --lr-decay-style cosine 
    --min-lr 6.0e-6
    --lr-warmup-fraction .001 
    --lr-decay-samples 45 
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 1 
	--pipeline-model-parallel-size 2 
	--pipeline-schedule ${SCHEDULE:-2bw}
)

DATA_ARGS=(
    --data-path $DATA_PATH 
    --vocab-file $VOCAB_FILE 
    --merge-file $MERGE_FILE 
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 8 
    --eval-interval 8 
    --save $CHECKPOINT_PATH 
    --load $CHECKPOINT_PATH 
    --eval-iters 1
    --tensorboard-dir $TENSORBOARD_LOGS_PATH 
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt_2bw.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} \
    "${@:6}"
