#!/bin/bash
# megatron-2bw plan for GPT L=4 h=64 a=4 s=32 on 1 x 8 (dgx-a100), B=16
# layout t1 d1 w8 b2 m1 megatron e2: predicted 39372.47 samples/s, 0.000 s/iteration, 0.07 GiB per device
# usage: DATA_PATH=... TOKENIZER_MODEL=... [NNODES=.. NODE_RANK=.. MASTER_ADDR=.. MASTER_PORT=..] bash launch.sh [more flags]
#   DATA_ARGS='--mock-data --vocab-size N' replaces the data flags; REPO, PYTHON: the checkout and interpreter
set -euo pipefail
if [[ -z ${REPO:-} ]]; then
    REPO=/work/main
fi
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=/work/main/.venv/bin/python
    [[ -x $PYTHON ]] || PYTHON=python3
fi
ENTRY="$REPO/pretrain_gpt_2bw.py"
if [[ ! -f $ENTRY ]]; then
    echo "error: REPO: $REPO has no pretrain_gpt_2bw.py; set REPO to the megatron-2bw checkout" >&2
    exit 2
fi
if [[ -z ${DATA_ARGS:-} && ( -z ${DATA_PATH:-} || -z ${TOKENIZER_MODEL:-} ) ]]; then
    echo "error: DATA_PATH: set DATA_PATH and TOKENIZER_MODEL, or DATA_ARGS (e.g. DATA_ARGS='--mock-data --vocab-size N')" >&2
    exit 2
fi
case " $* " in
    *" --train-iters"* | *" --train-samples"*) ;;
    *) echo "error: --train-iters: the plan has no training length; add --train-iters N or --train-samples N" >&2
       exit 2 ;;
esac
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
# shellcheck disable=SC2086
"$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node 8 \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    "$ENTRY" \
    --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 1 \
    --pipeline-schedule megatron \
    --num-layers 4 \
    --hidden-size 64 \
    --num-attention-heads 4 \
    --seq-length 32 \
    --max-position-embeddings 32 \
    --micro-batch-size 2 \
    --global-batch-size 16 \
    --num-experts 4 \
    --moe-router-topk 2 \
    --moe-token-dispatcher-type alltoall \
    --expert-model-parallel-size 2 \
    --bf16 \
    --optimizer muon \
    --lr 1.5e-4 \
    ${DATA_ARGS:---data-path "$DATA_PATH" --tokenizer-model "$TOKENIZER_MODEL"} "$@"
