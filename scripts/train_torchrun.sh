#!/bin/bash
# Train one of the paper's models with one schedule on this node (torchrun).
#
#   MODEL=gpt-2.2b SCHEDULE=2bw DATA_PATH=... TOKENIZER_MODEL=... bash scripts/train_torchrun.sh
#   MODEL=bert-3.8b SCHEDULE=megatron TP=8 DRY_RUN=1 MOCK_DATA=1 bash scripts/train_torchrun.sh
#   MODEL=gpt-tiny SCHEDULE=2bw GPUS_PER_NODE=2 CPU=1 PRECISION=fp32 MOCK_DATA=1 \
#       bash scripts/train_torchrun.sh
#
# Variables: see scripts/models.sh (MODEL, SCHEDULE, NODES, GPUS_PER_NODE, TP, PP, MICRO_BATCH,
# GLOBAL_BATCH, DATA_PATH, TOKENIZER_MODEL, ...). Several nodes without Slurm: run this on every
# node with NODES, NODE_RANK and MASTER_ADDR set. Flags after the script name are appended
# (they override the defaults). Prints the command it runs; DRY_RUN=1 only prints it.
set -euo pipefail
# shellcheck source=scripts/models.sh
source "$(dirname "${BASH_SOURCE[0]}")/models.sh"

training_args
launcher=(
    "${TORCHRUN:-$(default_torchrun)}"
    --nnodes "$NODES" --node-rank "${NODE_RANK:-0}" --nproc-per-node "$GPUS_PER_NODE"
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}"
)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
run_or_print "${launcher[@]}" "$ENTRY" "${TRAIN_ARGS[@]}" "$@"
