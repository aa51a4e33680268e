#!/bin/bash
# The paper's baseline comparison on one node (PipeDream-2BW, Figures 6 and 7): one model and
# global batch trained with Megatron tensor MP, inter-layer MP, GPipe, PipeDream-Flush and
# PipeDream-2BW in turn (scripts/train_torchrun.sh, each schedule in its default layout from
# scripts/models.sh), then one table and bar chart from their logs (tools/compare.py).
#
#   MODEL=gpt-2.2b DATA_PATH=... TOKENIZER_MODEL=... bash scripts/baselines.sh
#   MODEL=gpt-tiny GPUS_PER_NODE=2 CPU=1 PRECISION=fp32 MOCK_DATA=1 bash scripts/baselines.sh
#
# SCHEDULES [megatron naive gpipe flush 2bw], LOG_DIR [runs/baselines], and everything
# scripts/models.sh reads. For a fair comparison every schedule runs with CLIP_GRAD=0 and
# UNTIE=1 unless set: a grad-norm all-reduce (clipping) or the tied-embedding all-reduce syncs
# all stages at each step, which stalls 2BW's pipeline (the flushing schedules pay it anyway).
# Throughput runs: TRAIN_ITERS [60], EVAL_ITERS [0]. Each schedule's TP/PP come from its
# default layout (use scripts/train_torchrun.sh for other layouts). Several nodes: submit
# scripts/train_slurm.sbatch once per SCHEDULE and run tools/compare.py --from-logs on the logs.
# DRY_RUN=1 prints the commands only.
set -euo pipefail
# shellcheck source=scripts/models.sh
source "$(dirname "${BASH_SOURCE[0]}")/models.sh"

export CLIP_GRAD="${CLIP_GRAD:-0}" UNTIE="${UNTIE:-1}"
export TRAIN_ITERS="${TRAIN_ITERS:-60}" EVAL_ITERS="${EVAL_ITERS:-0}"
export MODEL="${MODEL:-gpt-2.2b}"
LOG_DIR="${LOG_DIR:-$REPO/runs/baselines}"
read -r -a schedules <<< "${SCHEDULES:-megatron naive gpipe flush 2bw}"

label() {
    case "$1" in
        megatron) echo "Tensor MP" ;; naive) echo "Inter-layer MP" ;; gpipe) echo "GPipe" ;;
        flush) echo "PipeDream-Flush" ;; 2bw) echo "PipeDream-2BW" ;; *) echo "$1" ;;
    esac
}

model_shape "$MODEL"  # a bad MODEL or schedule fails here, before any run
for schedule in "${schedules[@]}"; do
    (GPUS_PER_NODE=8; schedule_layout "$schedule")
done
[[ ${DRY_RUN:-0} == 1 ]] || mkdir -p "$LOG_DIR"
logs=()
for schedule in "${schedules[@]}"; do
    log="$LOG_DIR/${MODEL}_${schedule}.log"
    logs+=("$(label "$schedule")=$log")
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        (unset TP PP; SCHEDULE="$schedule" bash "$REPO/scripts/train_torchrun.sh" "$@")
    else
        echo "== $schedule: log $log"
        (unset TP PP; SCHEDULE="$schedule" bash "$REPO/scripts/train_torchrun.sh" "$@") 2>&1 \
            | tee "$log"
    fi
done
python="$REPO/.venv/bin/python"
[[ -x $python ]] || python=python3
run_or_print "$python" "$REPO/tools/compare.py" --from-logs "${logs[@]}" \
    --png "$LOG_DIR/${MODEL}_baselines.png" --json "$LOG_DIR/${MODEL}_baselines.json"
