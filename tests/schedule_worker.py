"""Pipeline side of the schedule exactness tests (tests/test_schedules_exact.py).

    python tests/schedule_worker.py SPEC.json               # launcher: forks every process
    torchrun --standalone --nproc-per-node N tests/schedule_worker.py SPEC.json --group NAME

The launcher imports torch and megatron-core once, forks one process for the single-process
reference jobs (tests/reference.py; they write the initial weights), then per launch group
`world` processes over gloo, which run the group's runs one after another: build with
megatron_2bw.training.build from Megatron-LM flags, load their slice of the initial weights,
train like the loop, and write their parameters under PP=1/TP=1 names and their losses.
Invariants: every process of a group is waited for on its own (only the group's deadline
kills); each group's exit codes and wall time land in <out>/launch.json, each rank's output in
<out>/<group>/rank<r>.log, each run's result in <out>/<run>/rank<r>.pt. The spec and the run
fields (fail, stall, split, model, ...): docs/testing.md, "The pipeline workers".
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import replace
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tests` and `pretrain_gpt_2bw` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from megatron_2bw.runtime.ports import free_port, free_ports

from tests.reference import LLAMA_FLAGS, MODEL, Model, initial_weights_of, microbatch


# ---- one process ----------------------------------------------------------------------------

def training_flags(run: dict, model: Model, world_size: int) -> list[str]:
    """Megatron-LM flags of one run: the model's sizes and optimizer, the run's layout."""
    tp, pp = run["tp"], run["pp"]
    dp = world_size // (tp * pp)
    flags = [
        "--num-layers", model.num_layers, "--hidden-size", model.hidden_size,
        "--num-attention-heads", model.num_attention_heads, "--seq-length", model.seq_length,
        "--max-position-embeddings", model.seq_length, "--vocab-size", model.vocab_size,
        "--mock-data", "--cpu", "--hidden-dropout", 0.0, "--attention-dropout", 0.0,
        "--init-method-std", model.init_method_std,
        "--micro-batch-size", model.micro_batch_size,
        "--global-batch-size", model.micro_batch_size * dp * run["m"],
        "--train-iters", run["iters"], "--optimizer", model.optimizer, "--lr", model.lr,
        "--lr-decay-style", "constant", "--lr-warmup-iters", model.lr_warmup_iters,
        "--weight-decay", model.weight_decay, "--clip-grad", model.clip_grad,
        "--adam-beta1", model.adam_beta1, "--adam-beta2", model.adam_beta2,
        "--adam-eps", model.adam_eps, "--seed", model.seed,
        "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp,
        "--pipeline-schedule", run["schedule"],
    ]
    if run.get("recompute"):
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", 1]
    if not run.get("tie", True):
        flags.append("--untie-embeddings-and-output-weights")
    if model.llama:
        flags += [*LLAMA_FLAGS, "--ffn-hidden-size", 4 * model.hidden_size]
    if model.optimizer == "muon":
        # fp32 Newton-Schulz, as the references compute it (the default iterates in bf16)
        flags += ["--muon-momentum", model.muon_momentum, "--muon-fp32-matmul-prec", "high"] + (
            ["--muon-use-nesterov"] if model.muon_nesterov else [])
    if model.correction != "none":
        flags += ["--stale-weight-correction", model.correction,
                  "--stale-weight-correction-coeff", model.correction_coeff]
    flags += moe_flags(model.moe)
    flags += run.get("flags", [])
    return [str(f) for f in flags]


def moe_flags(fields: dict | None) -> list:
    """Megatron-LM's flags for megatron-core's MoE config fields (tests/reference.py
    ``Model.moe``): --num-experts for num_moe_experts, every other field's own flag; a list
    value as several arguments (--moe-layer-freq: as its pattern text)."""
    flags: list = []
    for name, value in (fields or {}).items():
        flag = "--num-experts" if name == "num_moe_experts" else "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list) and name == "moe_layer_freq":
            flags += [flag, "[" + ",".join(str(v) for v in value) + "]"]
        elif isinstance(value, list):
            flags += [flag, *value]
        else:
            flags += [flag, value]
    return flags


def _global_name(name: str, stage: int, depth: int, num_layers: int, chunk: int = 0,
                 chunks: int = 1, schedule: str = "flush", split: list | None = None) -> str:
    """A chunk's parameter name as it is in the PP=1 model: chunk c of stage s is virtual
    stage v (c*d + s; under zb-v and dualpipev, the V: s, and 2d-1-s for c = 1) and holds
    global layers v*L/(dV) .. (v+1)*L/(dV) - 1, numbered from 0 inside the chunk; with an
    uneven ``split`` (the run's layers per virtual stage in model order, as the test states
    them) from split[0] + ... + split[v-1] on."""
    from megatron_2bw.schedules import placement_of

    virtual = placement_of(schedule, depth, chunks).virtual(stage, chunk)
    offset = sum(split[:virtual]) if split else virtual * num_layers // (depth * chunks)
    parts = name.removeprefix("module.").split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return _global_expert(".".join(parts))


def _global_expert(name: str) -> str:
    """A MoE layer's local expert i on expert-parallel rank r is global expert r E/EP + i."""
    from megatron.core import parallel_state as ps

    marker = ".experts.local_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker)
    local, rest = tail.split(".", 1)
    per_rank = MOE_EXPERTS_PER_RANK[0]
    return f"{head}{marker}{ps.get_expert_model_parallel_rank() * per_rank + int(local)}.{rest}"


MOE_EXPERTS_PER_RANK = [0]
"""The run's experts per expert-parallel rank (set by ``_run``)."""


def _tp_slice(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of ``full`` along the dimension tensor parallelism splits ``param``
    on: the expert-tensor-parallel group's for expert parameters, the tensor-parallel one's
    otherwise."""
    from megatron.core import parallel_state as ps

    dim = _split_dim(param)
    if dim is None:
        return full
    if not getattr(param, "allreduce", True):  # megatron-core marks expert parameters so
        world, rank = (ps.get_expert_tensor_parallel_world_size(),
                       ps.get_expert_tensor_parallel_rank())
    else:
        world, rank = (ps.get_tensor_model_parallel_world_size(),
                       ps.get_tensor_model_parallel_rank())
    return full.chunk(world, dim=dim)[rank]


def _split_dim(param: torch.nn.Parameter) -> int | None:
    """The dimension tensor parallelism splits `param` on (None: replicated)."""
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def _load_slice(model, init: dict, tie: bool, num_layers: int, schedule: str,
                split: list | None = None) -> None:
    """Copy this rank's slice of the full initial weights into its chunks' parameters. With
    tied embeddings the last stage's output_layer.weight is a copy of the word embeddings."""
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    depth = ps.get_pipeline_model_parallel_world_size()
    with torch.no_grad():
        for c, name, p in _chunk_params(model):
            chunks = len(model) if isinstance(model, (list, tuple)) else 1
            full_name = _global_name(name, stage, depth, num_layers, c, chunks, schedule, split)
            if full_name == "output_layer.weight" and tie:
                full_name = "embedding.word_embeddings.weight"
            full = _tp_slice(p, init[full_name])
            if full.shape != p.shape:
                raise ValueError(f"{name}: slice {tuple(full.shape)} != parameter {tuple(p.shape)}")
            p.copy_(full)


def _chunk_params(model):
    """(chunk index, name, parameter) over the stage's model chunks: a list of DDP-wrapped
    chunks, or one bare model."""
    for c, chunk in enumerate(model if isinstance(model, (list, tuple)) else [model]):
        for name, p in getattr(chunk, "module", chunk).named_parameters():
            yield c, name, p


def _data(model: Model, m: int):
    """This rank's microbatches of every batch in order (2BW reads ahead into the next batch)."""
    from megatron.core import parallel_state as ps

    replica, k = ps.get_data_parallel_rank(), 0
    while True:
        yield microbatch(model, k // m, replica, k % m)
        k += 1


def _inject_send_failure(stage: int, nth: int) -> None:
    """Make the exchange that holds this process's nth pipeline send raise."""
    from megatron_2bw.schedules import p2p

    original, sends = p2p.StageComm.exchange, [0]

    def failing_exchange(self, exchange, outgoing, before):
        count = sum(t.op == "send" for t in exchange.transfers)
        if sends[0] < nth <= sends[0] + count:
            print(f"injected failure at unix time {time.time():.3f}", file=sys.stderr, flush=True)
            raise p2p.CommError(f"stage {stage}: injected failure in {exchange}")
        sends[0] += count
        return original(self, exchange, outgoing, before)

    p2p.StageComm.exchange = failing_exchange


def _inject_stall(nth: int) -> None:
    """Stop this process (SIGSTOP: a frozen node) when it reaches its nth exchange."""
    import signal

    from megatron_2bw.schedules import p2p

    original, calls = p2p.StageComm.exchange, [0]

    def stalling_exchange(self, exchange, outgoing, before):
        calls[0] += 1
        if calls[0] == nth:
            print(f"stopping at {exchange} at unix time {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(self, exchange, outgoing, before)

    p2p.StageComm.exchange = stalling_exchange


def _run(run: dict, init_path: str, out: Path, timeout_minutes: float) -> None:
    import megatron_2bw
    from megatron.core import parallel_state as ps
    from megatron.core import pipeline_parallel

    import pretrain_gpt_2bw
    from megatron_2bw.arguments import parse_args
    from megatron_2bw.runtime import distributed
    from megatron_2bw.schedules import executor
    from megatron_2bw.training import build

    model_spec = replace(MODEL, **run.get("model", {}))
    world = int(os.environ["WORLD_SIZE"])
    if ps.model_parallel_is_initialized():
        from tests.dist import tear_down_groups

        executor.reset_runners()  # the last run's runner holds its model and optimizer
        tear_down_groups()  # the last run's groups (and their gloo threads) go
    args = parse_args(training_flags(run, model_spec, world), world_size=world)
    info = distributed.initialize(run["tp"], run["pp"], model_spec.seed, force_cpu=True,
                                  timeout_minutes=timeout_minutes,
                                  virtual_stages=args.virtual_pipeline_model_parallel_size,
                                  expert_parallel=args.expert_model_parallel_size,
                                  expert_tensor_parallel=args.expert_tensor_parallel_size)
    MOE_EXPERTS_PER_RANK[0] = (args.num_experts or 0) // args.expert_model_parallel_size
    config = build.transformer_config(args, info.device)
    provider = partial(pretrain_gpt_2bw.model_provider, args=args,
                       vocab_size=model_spec.vocab_size)
    model = build.build_model(args, config, provider)
    tie = run.get("tie", True)
    initial = None
    if run.get("from_seed"):  # megatron-2bw's own initialization: keep it, save it
        initial = {_global_name(name, info.pp_rank, run["pp"], model_spec.num_layers, c,
                                len(model), run["schedule"], run.get("split")):
                   (p.detach().clone(), _split_dim(p))
                   for c, name, p in _chunk_params(model)}
    elif init_path:  # else megatron-core's own initialization from the seed
        _load_slice(model, initial_weights_of(torch.load(init_path), model_spec), tie,
                    model_spec.num_layers, run["schedule"], run.get("split"))
    optimizer = build.build_optimizer(args, model)
    scheduler = build.build_scheduler(args, optimizer)
    build.attach_config_hooks(config, model, optimizer, align_grad_reduce=args.align_grad_reduce)
    param_gathers = _count_param_gathers(config, model)
    all_to_alls = _count_all_to_alls_by_pass() if run.get("count_all_to_alls") else None
    executor.reset_runners()
    megatron_2bw.install(run["schedule"])
    fb = pipeline_parallel.get_forward_backward_func()
    if run.get("fail") and info.pp_rank == run["fail"]["stage"]:
        _inject_send_failure(info.pp_rank, run["fail"]["send"])
    if run.get("stall") and info.pp_rank == run["stall"]["stage"]:
        _inject_stall(run["stall"]["exchange"])

    started = time.perf_counter()
    data = [_data(model_spec, args.num_microbatches) for _ in model]  # one stream per chunk
    data = data[0] if len(data) == 1 else data
    host_syncs = []
    logged = train_iterations(
        run["name"], args, fb, pretrain_gpt_2bw.forward_step, data, model, optimizer, scheduler,
        defer=run.get("deferred", True), drains=tuple(run.get("drains", ())),
        host_syncs=host_syncs,
        round_trip=out / run["name"] / "versions" if run.get("round_trip") else None)
    losses = [record["lm loss"] for record in logged]
    with build.forward_pre_hook_paused(model):  # --overlap-param-gather: the last all-gather
        seconds = time.perf_counter() - started

    params = {}
    for c, name, p in _chunk_params(model):
        key = _global_name(name, info.pp_rank, run["pp"], model_spec.num_layers, c, len(model),
                           run["schedule"], run.get("split"))
        if key == "output_layer.weight" and tie:
            key = "tied:output_layer.weight"  # the last stage's copy of the word embeddings
        params[key] = (p.detach().clone(), _split_dim(p))
    (out / run["name"]).mkdir(parents=True, exist_ok=True)
    torch.save({"tp": info.tp_rank, "pp": info.pp_rank, "dp": info.dp_rank, "params": params,
                "losses": losses, "seconds": seconds,
                "step_mode": getattr(fb, "step_mode", None),
                "deferred_launched": dict(getattr(getattr(fb, "deferred", None), "launched",
                                                  None) or {}),
                # DDP's hooks ran with the reductions on at some backward (a bucket group
                # records its per-parameter readiness then and leaves its first-batch mode)
                "hooks_reduced": all(not group.is_first_batch for chunk in model
                                     for group in getattr(chunk, "bucket_groups", ())),
                "param_gathers": param_gathers, "host_syncs": host_syncs, "logged": logged,
                "initial_params": initial, "all_to_alls": all_to_alls},
               out / run["name"] / f"rank{info.rank}.pt")
    print(f"rank {info.rank}: {run['name']} finished {args.train_iters} iterations in "
          f"{seconds:.1f} s", flush=True)


def _count_all_to_alls_by_pass() -> dict:
    """Count torch.distributed.all_to_all_single calls (MoE's token dispatch) by the pass that
    issues them: a zero-bubble input-gradient pass ("I"), weight-gradient pass ("W"), or
    elsewhere ("other": forwards, fused backwards)."""
    import torch.distributed as dist

    from megatron_2bw.schedules.wgrad import WeightGradStore

    counts, phase = {"I": 0, "W": 0, "other": 0, "W_expert_gemms": 0}, ["other"]
    original = dist.all_to_all_single

    def counted(*args, **kwargs):
        counts[phase[0]] += 1
        return original(*args, **kwargs)

    def in_phase(name, function):
        def run(*args, **kwargs):
            if name == "W":  # the experts' GEMMs among the deferred ones (allreduce False)
                counts["W_expert_gemms"] += sum(not getattr(item.weight, "allreduce", True)
                                                for item in args[0].pending)
            phase[0] = name
            try:
                return function(*args, **kwargs)
            finally:
                phase[0] = "other"
        return run

    dist.all_to_all_single = counted
    WeightGradStore.input_pass = in_phase("I", WeightGradStore.input_pass)
    WeightGradStore.weight_pass = staticmethod(in_phase("W", WeightGradStore.weight_pass))
    return counts


def _count_param_gathers(config, model: list) -> list[dict]:
    """Per chunk, as the run goes: how often the schedule launched its parameter all-gathers
    (``config.param_sync_func``: virtual stages with --overlap-param-gather) and how often one
    of its bucket groups had been launched already then (a pre-hook was first: too late)."""
    counts = [{"launched": 0, "late": 0} for _ in model]
    if not isinstance(config.param_sync_func, list):
        return counts

    def counted(chunk: int, launch):
        def launch_counted(*args, **kwargs):
            counts[chunk]["launched"] += 1
            counts[chunk]["late"] += any(group.param_gather_dispatched
                                         for group in model[chunk].bucket_groups)
            return launch(*args, **kwargs)
        return launch_counted

    config.param_sync_func = [counted(c, f) for c, f in enumerate(config.param_sync_func)]
    return counts


def _round_trip_versions(fb, model, directory: Path) -> None:
    """Save the schedule's weight versions (``checkpoint_extra``: every older version, as a
    checkpoint holds them), overwrite every older slot with NaN, and load them back
    (``prepare_load``, ``checkpoint_loaded``): a version lost on the way spoils the weights
    the run ends with."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_2bw.corrections import DelayCompensation, ErrorFeedback
    from megatron_2bw.runtime.lifetime import bind_helpers_to_this_process

    bind_helpers_to_this_process()  # as training's saves: no Manager server to outlive the rank
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sharded: dict = {}
    fb.checkpoint_extra(model, sharded)
    dist_checkpointing.save(sharded, str(directory))
    stale = getattr(fb, "stale", None)
    state = None if stale is None or not getattr(stale, "holds_state", True) else (
        stale.load_targets() if isinstance(stale, (ErrorFeedback, DelayCompensation))
        else stale.state_tensors())
    with torch.no_grad():
        for tensors in [t for _, t in fb.versions.older_versions()] + [state or []]:
            for tensor in tensors:
                tensor.fill_(float("nan"))
    sharded = {}
    fb.prepare_load(model, sharded, str(directory))
    fb.checkpoint_loaded(model, dist_checkpointing.load(sharded, str(directory)))


def train_iterations(name: str, args, fb, forward_step, data, model, optimizer,
                     scheduler, defer: bool = True, drains: tuple[int, ...] = (),
                     host_syncs: list | None = None,
                     round_trip: Path | None = None) -> list[dict]:
    """Megatron's training step, ``args.train_iters`` times, with the schedule's drain on the
    last and after the iterations in ``drains`` (as before an evaluation: ``prepare_drain``,
    the call, the step, ``drain()``); on the stage that computes the loss, each iteration's
    mean of every logged loss. The schedule gets the optimizer first (2bw defers its step
    unless ``defer`` is False). Where the host-sync counter is installed (tests/strict/
    host_syncs.py), ``host_syncs`` gets each iteration's syncs by site (from one iteration's
    start to the next's; the last iteration's up to the end, its drain included)."""
    from tests.strict import host_syncs as sync_counter

    counter = sync_counter.counter() if host_syncs is not None else None
    marks = []
    if hasattr(fb, "attach_optimizer"):
        from megatron_2bw.corrections import StaleCorrection

        fb.attach_optimizer(optimizer, defer=defer, correction=StaleCorrection.from_args(args))
    if args.pipeline_schedule == "pipemare":
        from megatron_2bw.schedules.pipemare import PipeMareOptions

        fb.configure_pipemare(PipeMareOptions.from_args(args))
    losses = []
    for iteration in range(args.train_iters):
        if counter is not None:
            marks.append(counter.snapshot()[1])
        pauses = {args.train_iters - 1, *drains}
        if hasattr(fb, "prepare_drain"):  # as early as the schedule needs to know
            notice = fb.drain_notice(args.num_microbatches)
            ahead = next((a for a in range(notice) if iteration + a in pauses), None)
            if ahead is not None:
                fb.prepare_drain(ahead + 1)
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        loss_dicts = fb(forward_step_func=forward_step, data_iterator=data, model=model,
                        num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                        micro_batch_size=args.micro_batch_size,
                        decoder_seq_length=args.seq_length, forward_only=False)
        succeeded, _, _ = optimizer.step()
        if not succeeded:
            raise RuntimeError(f"{name}: optimizer step {iteration} was skipped")
        scheduler.step(increment=args.global_batch_size)  # counts samples
        moe_logged = _moe_logged(args)  # a collective: every rank
        if loss_dicts:
            losses.append({key: float(torch.stack([d[key] for d in loss_dicts]).mean())
                           for key in loss_dicts[0]} | moe_logged)
        if iteration in drains and hasattr(fb, "drain"):
            fb.drain()
            if round_trip is not None:
                _round_trip_versions(fb, model, round_trip / f"iteration{iteration}")
    if hasattr(fb, "drain"):
        fb.drain()
    if counter is not None:
        marks.append(counter.snapshot()[1])
        host_syncs.extend({site: n - before.get(site, 0) for site, n in after.items()
                           if n != before.get(site, 0)} for before, after in zip(marks, marks[1:]))
    return losses


def _moe_logged(args) -> dict:
    """A MoE model's load-balancing losses of the iteration, as the training loop logs them
    (``training.moe.moe_metrics``); {} for a dense model."""
    from megatron_2bw.training import moe

    if not moe.is_moe(args):
        return {}
    return {name: moe.logged_value(args, layers)
            for name, layers in moe.moe_metrics(args, args.num_microbatches).items()}


def run_group(spec: dict, group: str) -> None:
    """This process's part of every run of `group` (torch.distributed env vars set)."""
    from megatron_2bw.runtime import distributed

    out = Path(spec["out"])
    minutes = spec["groups"][group].get("timeout_minutes", spec.get("timeout_minutes", 2.0))
    for run in spec["groups"][group]["runs"]:
        _run(run, spec["init"], out, minutes)
    distributed.destroy()


# ---- the launcher ---------------------------------------------------------------------------

def _child(rank: int, world: int, port: int, log: str, target, *target_args) -> None:
    """A forked process: its own log file, torchrun's environment variables, then `target`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        target(*target_args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (state T in /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def fork_all(world: int, logs: Path, timeout_s: float, target, *target_args) -> dict:
    """Fork `world` processes running `target`; wait for each (killing all at the deadline)."""
    return _wait(*_fork(world, logs, free_port(), target, *target_args), timeout_s)


def _fork(world: int, logs: Path, port: int, target, *target_args) -> tuple[list, float]:
    """`world` started processes running `target` (one process group on `port`), and when
    they started."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    logs.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    procs = [context.Process(target=_child, args=(rank, world, port, str(logs / f"rank{rank}.log"),
                                                  target, *target_args))
             for rank in range(world)]
    for p in procs:
        p.start()
    return procs, started


def _wait(procs: list, started: float, timeout_s: float) -> dict:
    """Wait for the processes of one `_fork`, killing all of them at the deadline."""
    deadline = started + timeout_s
    while any(p.is_alive() for p in procs) and time.perf_counter() < deadline:
        if all(_stopped(p.pid) for p in procs if p.is_alive()):
            break  # only SIGSTOPped processes are left: none of them can go on
        time.sleep(0.2)
    timed_out = time.perf_counter() >= deadline
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return {"exit_codes": [p.exitcode for p in procs], "timed_out": timed_out,
            "seconds": time.perf_counter() - started}


def launch(spec_path: str) -> None:
    from megatron.core import jit

    jit.disable_jit_fuser()  # before any model module is imported (as the CPU runtime does)
    import megatron.core.distributed  # noqa: F401  (imported once here, shared by every fork)
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401

    import megatron_2bw.schedules.executor  # noqa: F401
    import megatron_2bw.training.build  # noqa: F401
    import pretrain_gpt_2bw  # noqa: F401
    from tests import reference

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("count_host_syncs"):  # installed before the forks: every process counts
        from tests.strict import host_syncs

        host_syncs.install()
    out = Path(spec["out"])
    summary = {}
    referencing = None
    if spec.get("reference"):  # runs beside the groups once it wrote the initial weights
        referencing = fork_beside(out / "reference", spec["init"], 600, reference.run_jobs,
                                  spec["init"], spec["out"], spec["reference"])
    if referencing is None or Path(spec["init"]).exists():
        groups = spec.get("groups", {})
        for name, group in groups.items():
            if not group.get("waits"):
                summary[name] = fork_all(group["world"], out / name,
                                          group.get("timeout_s", 300), run_group, spec, name)
                print(f"{name}:", summary[name], flush=True)
        # groups that mostly wait (for a failed peer, until their timeout) run side by side
        waits = [name for name, group in groups.items() if group.get("waits")]
        waiting = {name: _fork(groups[name]["world"], out / name, port, run_group, spec, name)
                   for name, port in zip(waits, free_ports(len(waits)))}
        for name, forked in waiting.items():
            summary[name] = _wait(*forked, groups[name].get("timeout_s", 300))
            print(f"{name}:", summary[name], flush=True)
    if referencing is not None:
        summary = {"reference": _wait(*referencing, 600), **summary}
        print("reference:", summary["reference"], flush=True)
    (out / "launch.json").write_text(json.dumps(summary, indent=1))


def fork_beside(logs: Path, ready: str, timeout_s: float, target, *target_args) -> tuple:
    """Fork one process running ``target`` (a reference: it writes the file ``ready`` whole
    first, then goes on); return it, for ``_wait``, once ``ready`` exists, the process ended
    or ``timeout_s`` passed."""
    procs, started = _fork(1, logs, free_port(), target, *target_args)
    while not Path(ready).exists() and procs[0].is_alive() \
            and time.perf_counter() < started + timeout_s:
        time.sleep(0.05)
    return procs, started


def main(argv: list[str]) -> None:
    if "--group" in argv:  # one process of a torchrun launch
        spec = json.loads(Path(argv[0]).read_text())
        run_group(spec, argv[argv.index("--group") + 1])
    else:
        launch(argv[0])


if __name__ == "__main__":
    main(sys.argv[1:])
