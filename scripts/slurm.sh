# shellcheck shell=bash
# Sourced by scripts/train_slurm.sbatch and the planner's plan.sbatch inside a Slurm job: the
# rendezvous host, the job's start line, and the job step run so that a pre-emption (SIGTERM)
# or a time-limit warning (sbatch --signal=B:USR1@N) ends with a checkpoint and an exit status
# that says whether to requeue. docs/slurm.md tells the story.
#
# RDZV_ADDR [the first node's NodeAddr]: the rendezvous host; RDZV_TIMEOUT [600]: seconds a
# node waits for the others at the rendezvous; REQUEUE_EXIT [75]: the exit status of a job that
# stopped early with a checkpoint (resubmit or requeue it to go on).

REQUEUE_EXIT="${REQUEUE_EXIT:-75}"

slurm_die() {
    echo "error: $*" >&2
    exit 2
}

# slurm_rendezvous_addr -> prints the address the rendezvous listens on: RDZV_ADDR, else the
# NodeAddr of the job's first node (node names need not resolve; Slurm reaches nodes by it)
slurm_rendezvous_addr() {
    local first addr
    if [[ -n ${RDZV_ADDR:-} ]]; then
        echo "$RDZV_ADDR"
        return
    fi
    # sed reads the whole list: no SIGPIPE under pipefail
    first="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
    addr="$(scontrol show node "$first" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')"
    echo "${addr:-$first}"
}

# slurm_check_resolves HOST -> one error line and exit 2 unless HOST resolves here
slurm_check_resolves() {
    getent hosts "$1" >/dev/null || slurm_die "the rendezvous address $1 does not resolve on" \
        "$(hostname); set RDZV_ADDR to the first node's address"
}

# slurm_start_line -> one line: the job, its nodes and how often it was requeued
slurm_start_line() {
    echo "slurm job ${SLURM_JOB_ID:-?} on ${SLURM_NNODES:-?} node(s) ${SLURM_JOB_NODELIST:-?}," \
        "SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}, started $(date -u +%FT%TZ)"
}

_stop_signal=""
_forwarded=""

# slurm_run_step COMMAND... -> runs the job step (srun ...) in the background and waits for
# it. SIGTERM (scancel, pre-emption, scontrol requeue) reaches the step from Slurm itself;
# SIGUSR1 (the time-limit warning, sent to this shell alone) is forwarded to the step as
# SIGTERM. The traps only record the signal: a handler doing work can lose a signal that
# arrives while it runs. SIGCONT is left alone. Exit status: the step's when no signal came;
# REQUEUE_EXIT after a signal (the ranks saved), after requeueing the job itself on a
# time-limit warning when it was submitted with --requeue.
slurm_run_step() {
    local step status
    trap '_stop_signal=USR1' USR1
    trap '_stop_signal=${_stop_signal:-TERM}' TERM
    "$@" &
    step=$!
    while :; do
        wait "$step" && status=0 || status=$?
        if [[ -n $_stop_signal && -z $_forwarded ]]; then
            _forwarded="$_stop_signal"
            _slurm_forward "$_stop_signal"
        fi
        kill -0 "$step" 2>/dev/null || break
    done
    _slurm_step_ended "$status"
}

# _slurm_forward SIGNAL -> one line; a time-limit warning (USR1) goes to the step as SIGTERM
_slurm_forward() {
    if [[ $1 == USR1 ]]; then
        echo "time limit near (SIGUSR1): asking the ranks to save and stop (SIGTERM)"
        scancel --signal=TERM "$SLURM_JOB_ID" || true
    else
        echo "SIGTERM (scancel, pre-emption or requeue): the ranks save and stop"
    fi
}

# _slurm_step_ended STATUS -> the job's exit status (see slurm_run_step)
_slurm_step_ended() {
    if [[ -z $_stop_signal ]]; then
        (( $1 == 0 )) || echo "error: the training step failed (srun exit status $1): the" \
            "lines above say why" >&2
        return "$1"
    fi
    echo "stopped by SIG$_stop_signal with a checkpoint where --save is set; exit" \
        "$REQUEUE_EXIT: resubmit or requeue to resume"
    if [[ $_forwarded == USR1 && $(scontrol show job "$SLURM_JOB_ID") == *Requeue=1* ]]; then
        echo "requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID" || true
    fi
    return "$REQUEUE_EXIT"
}
