#!/bin/bash

# Runs the "340M" parameter model (Bert - Large)

# megatron-2bw: Megatron-LM's examples/bert/train_bert_340m_distributed.sh (core_v0.16.1),
# shrunk only in sizes and paths, for 1 node x 2 processes (CPU processes where there is no
# CUDA: the runtime picks gloo by itself). Build the data first:
#     python scripts/examples/prepare_data.py            # into data/cache/examples
#     bash scripts/examples/train_bert_340m_distributed.sh [CHECKPOINT_PATH \
#         TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH [more flags]]
# The hyperparameters are BERT-Large's: at --lr 1e-4, and with fp16's first ~20 steps skipped
# while the loss scale falls from 2^32, 8 iterations barely move the loss.
# Changed against the original (everything else is as there):
#   GPUS_PER_NODE          8 -> 2
#   MASTER_PORT            6000 -> ${MASTER_PORT:-6000}
#   $1..$4                 each falls back to an env var of the same name, then to a local
#                          default (checkpoints/, runs/, data/cache/examples/); arguments
#                          after $4 are appended to the training flags (they override)
#   --num-layers           24 -> 4
#   --hidden-size          1024 -> 64
#   --num-attention-heads  16 -> 4
#   --seq-length, --max-position-embeddings   512 -> 32
#   --micro-batch-size     4 -> 2
#   --global-batch-size    32 -> 8
#   --train-iters          1000000 -> 8
#   --lr-decay-iters       990000 -> 8
#   --tensor-model-parallel-size    8 -> 1
#   --pipeline-model-parallel-size  16 -> 2
#   --log-interval 100 -> 1, --save-interval 10000 -> 8, --eval-interval 1000 -> 8,
#   --eval-iters 10 -> 1
#   VOCAB_FILE bert-vocab.json -> bert-vocab.txt (a BERT vocabulary is one piece a line);
#   DATA_PATH ..._text_document -> ..._text_sentence (BERT reads sentence-level data:
#   tools/preprocess_data.py --split-sentences)
#   pretrain_bert.py -> pretrain_bert_2bw.py, plus --pipeline-schedule ${SCHEDULE:-2bw}

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=2
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

EXAMPLES_DATA=data/cache/examples
CHECKPOINT_PATH=${1:-${CHECKPOINT_PATH:-checkpoints/bert_340m_shrunk}} #<Specify path>
TENSORBOARD_LOGS_PATH=${2:-${TENSORBOARD_LOGS_PATH:-runs/tensorboard/bert_340m_shrunk}} #<Specify path>
VOCAB_FILE=${3:-${VOCAB_FILE:-$EXAMPLES_DATA/bert-vocab.txt}} #<Specify path to file>/bert-vocab.txt
DATA_PATH=${4:-${DATA_PATH:-$EXAMPLES_DATA/bert/my-bert_text_sentence}} #<Specify path and file prefix>_text_sentence

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE 
    --nnodes $NUM_NODES 
    --master_addr $MASTER_ADDR 
    --master_port $MASTER_PORT
)

BERT_MODEL_ARGS=(
    --num-layers 4 
    --hidden-size 64 
    --num-attention-heads 4 
    --seq-length 32 
    --max-position-embeddings 32 
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 2 
    --global-batch-size 8 
    --train-iters 8 
    --weight-decay 1e-2 
    --clip-grad 1.0 
    --fp16
    --lr 0.0001
    --lr-decay-iters 8 
    --lr-decay-style linear 
    --min-lr 1.0e-5 
    --weight-decay 1e-2 
    --lr-warmup-fraction .01 
    --clip-grad 1.0 
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 1 
	--pipeline-model-parallel-size 2 
	--pipeline-schedule ${SCHEDULE:-2bw}
)

DATA_ARGS=(
    --data-path $DATA_PATH 
    --vocab-file $VOCAB_FILE 
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

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_bert_2bw.py \
    ${BERT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} \
    "${@:5}"
