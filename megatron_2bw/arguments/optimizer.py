"""Optimizer flags and rules: Muon (--muon-*, dist_muon's layer-wise sharding), the
stale-weight corrections, and the data-parallel flags of megatron-core's DDP and distributed
optimizer (`_validate_ddp`)."""

from __future__ import annotations

import argparse

from megatron_2bw.arguments.common import _COUNT, _POSITIVE, _PROBABILITY, _require


def _add_muon_args(g) -> None:
    """Megatron-LM's --muon-* flags (its "regularization" group at core_v0.16.1), with its
    defaults."""
    g.add_argument("--muon-momentum", type=_PROBABILITY, default=0.9)
    g.add_argument("--muon-no-split-qkv", action="store_false", dest="muon_split_qkv",
                   help="orthogonalize the fused QKV weight whole, not per Q, K and V")
    g.add_argument("--muon-use-nesterov", action="store_true")
    g.add_argument("--muon-scale-mode", choices=("spectral", "unit_rms_norm", "shape_scaling"),
                   default="spectral")
    g.add_argument("--muon-fp32-matmul-prec", choices=("low", "medium", "high"),
                   default="medium", help="Newton-Schulz's matmul precision: medium and "
                   "low iterate in bf16 (Jordan's reference Muon), high in fp32 (TF32 on CUDA)")
    g.add_argument("--muon-num-ns-steps", type=_COUNT, default=5)
    g.add_argument("--muon-tp-mode", choices=("blockwise", "duplicated", "distributed"),
                   default="blockwise")
    g.add_argument("--muon-extra-scale-factor", type=_POSITIVE, default=1.0)


def _add_ddp_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's data-parallel flags (megatron/training/arguments.py at core_v0.16.1: its
    distributed and mixed-precision groups), from which ``build.ddp_config`` makes megatron-core's
    DistributedDataParallelConfig as Megatron-LM's ``get_model`` does. (--use-distributed-optimizer
    is with the training flags.) The rules: :func:`_validate_ddp`."""
    g = p.add_argument_group("data parallelism")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="launch the data-parallel gradient reductions bucket by bucket during "
                        "the last microbatch's backward pass")
    g.add_argument("--align-grad-reduce", action=argparse.BooleanOptionalAction, default=True,
                   help="with --overlap-grad-reduce, pipeline stages other than the first "
                        "launch their reductions after their last backward pass (Megatron-LM's "
                        "config.grad_sync_func); --no-align-grad-reduce: during it")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="distributed optimizer: all-gather the updated parameters bucket by "
                        "bucket in the next forward pass (needs --overlap-grad-reduce)")
    g.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true",
                   help="with virtual stages and --overlap-param-gather: the optimizer step "
                        "launches the first chunk's all-gather (no checkpoints, as in "
                        "Megatron-LM)")
    g.add_argument("--align-param-gather", action=argparse.BooleanOptionalAction, default=True,
                   help="with virtual stages and --overlap-param-gather: the schedule launches "
                        "each chunk's parameter all-gathers (config.param_sync_func); off "
                        "without virtual stages (as Megatron-LM sets it)")
    g.add_argument("--ddp-num-buckets", type=_COUNT, default=None,
                   help="split the gradient buffer into this many buckets")
    g.add_argument("--ddp-bucket-size", type=_COUNT, default=None,
                   help="parameters per gradient bucket; default with --overlap-grad-reduce: "
                        "max(40M, 1M x data-parallel size), one bucket without it")
    g.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true")
    g.add_argument("--ddp-reduce-scatter-with-fp32-accumulation", action="store_true")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="average in the data-parallel collective (ReduceOp.AVG; NCCL only)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="--bf16: accumulate and reduce gradients in bf16 (fp32 by default)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and reduce gradients in fp32 (implied by --bf16 unless "
                        "--grad-reduce-in-bf16)")
    g.add_argument("--check-for-large-grads", action="store_true",
                   help="megatron-core's check for unexpectedly large gradients before the "
                        "data-parallel collective")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=_COUNT, default=None,
                   help="refused for now (Megatron-LM: every N iterations check that all "
                        "data-parallel replicas hold the same weights)")
    g.add_argument("--num-distributed-optimizer-instances", type=_COUNT, default=1)
    g.add_argument("--use-torch-fsdp2", action="store_true", help="refused (see the error)")
    g.add_argument("--use-megatron-fsdp", action="store_true", help="refused (see the error)")


_MUON_DEFAULTS = {"muon_momentum": 0.9, "muon_split_qkv": True, "muon_use_nesterov": False,
                  "muon_scale_mode": "spectral", "muon_fp32_matmul_prec": "medium",
                  "muon_num_ns_steps": 5, "muon_tp_mode": "blockwise",
                  "muon_extra_scale_factor": 1.0}


def have_emerging_optimizers() -> bool:
    """Whether NVIDIA's emerging-optimizers imports (megatron-core's TensorParallelMuon needs
    it; it requires Python >= 3.12)."""
    import importlib.util

    return importlib.util.find_spec("emerging_optimizers") is not None


def _validate_layer_wise_muon(args: argparse.Namespace) -> None:
    """--optimizer dist_muon, as Megatron-LM reads it: --optimizer muon with its state sharded
    over the data-parallel ranks by whole parameters (megatron-core's
    LayerWiseDistributedOptimizer; ``use_layer_wise_distributed_optimizer``). megatron-core's
    distributed optimizer runs Adam only, so --optimizer muon --use-distributed-optimizer
    means the same here (docs/megatron_lm_compatibility.md)."""
    mapped = args.optimizer == "muon" and args.use_distributed_optimizer
    args.use_layer_wise_distributed_optimizer = args.optimizer == "dist_muon" or mapped
    if not args.use_layer_wise_distributed_optimizer:
        return
    if mapped:
        args.validation_notes = getattr(args, "validation_notes", []) + [
            "note: --optimizer muon --use-distributed-optimizer: Muon's state is sharded by "
            "whole parameters (megatron-core's LayerWiseDistributedOptimizer, Megatron-LM's "
            "--optimizer dist_muon); megatron-core's distributed optimizer runs Adam only"]
    args.optimizer, args.use_distributed_optimizer = "muon", False
    for flag in ("--overlap-param-gather", "--overlap-param-gather-with-optimizer-step"):
        _require(not getattr(args, flag[2:].replace("-", "_")), flag,
                 "not with --optimizer dist_muon (its layer-wise optimizer all-gathers the "
                 "updated parameters in its step, megatron-core 0.16)")


def _validate_muon(args: argparse.Namespace) -> None:
    """--optimizer muon as megatron-core builds it (``get_megatron_muon_optimizer``): not with
    fp16; without emerging-optimizers, blockwise tensor parallelism only. The --muon-* flags
    need it."""
    if args.optimizer != "muon":
        for dest, default in _MUON_DEFAULTS.items():
            flag = "--muon-no-split-qkv" if dest == "muon_split_qkv" else \
                "--" + dest.replace("_", "-")
            _require(getattr(args, dest) == default, flag,
                     f"only with --optimizer muon, not {args.optimizer}")
        return
    _require(not args.fp16, "--fp16", "not with --optimizer muon (megatron-core's Muon runs "
             "fp32 or bf16 only); use --bf16")
    _require(args.muon_tp_mode == "blockwise" or have_emerging_optimizers(), "--muon-tp-mode",
             f"{args.muon_tp_mode} needs NVIDIA's emerging-optimizers package (Python >= 3.12); "
             "without it each tensor-parallel rank orthogonalizes its shard (blockwise)")


def _validate_stale_correction(args: argparse.Namespace) -> None:
    """--stale-weight-correction: 2bw's one-step delay, corrected on the optimizer's fp32
    parameters (or master copies, or shards) under every precision and optimizer."""
    rule = args.stale_weight_correction
    if rule == "none":
        _require(args.stale_weight_correction_coeff is None, "--stale-weight-correction-coeff",
                 "only with --stale-weight-correction predict, dc or ef")
        return
    flag = "--stale-weight-correction"
    _require(args.pipeline_schedule == "2bw", flag,
             f"only with --pipeline-schedule 2bw, not {args.pipeline_schedule}: its corrections "
             "assume 2BW's delay of one step on every stage (pipedream and pipemare delay "
             "some microbatches of a batch on some stages)")


def _validate_ddp(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for the data-parallel flags (``validate_args`` in
    megatron/training/arguments.py at core_v0.16.1), the settings it derives from them
    (align_param_gather off without virtual pipeline stages; accumulate_allreduce_grads_in_fp32
    on with --bf16 unless --grad-reduce-in-bf16), and ours: what 2BW and the CPU cannot run."""
    for flag, why in (("use_torch_fsdp2", "torch FSDP2 shards the model, which megatron-2bw's "
                       "pipeline schedules and 2BW's weight versions do not handle; use "
                       "--use-distributed-optimizer"),
                      ("use_megatron_fsdp", "megatron FSDP shards the parameters, which "
                       "megatron-2bw's pipeline schedules and 2BW's weight versions do not "
                       "handle; use --use-distributed-optimizer")):
        _require(not getattr(args, flag), "--" + flag.replace("_", "-"), "not supported: " + why)
    _require(args.num_distributed_optimizer_instances == 1, "--num-distributed-optimizer-instances",
             "only 1 is supported (megatron-2bw builds megatron-core's process groups without "
             "the inter-instance groups of a partial distributed optimizer)")
    _require(args.ddp_num_buckets is None or args.ddp_bucket_size is None, "--ddp-num-buckets",
             "give --ddp-num-buckets or --ddp-bucket-size, not both")
    if args.use_distributed_optimizer:
        _require(args.optimizer == "adam", "--use-distributed-optimizer",
                 f"megatron-core's distributed optimizer runs Adam only, not --optimizer "
                 f"{args.optimizer}")
    if args.overlap_param_gather:
        _require(args.use_distributed_optimizer, "--overlap-param-gather",
                 "only supported with --use-distributed-optimizer")
        _require(args.overlap_grad_reduce, "--overlap-param-gather",
                 "needs --overlap-grad-reduce")
    if args.overlap_param_gather_with_optimizer_step:
        flag = "--overlap-param-gather-with-optimizer-step"
        _require(args.use_distributed_optimizer, flag,
                 "only supported with --use-distributed-optimizer")
        _require(args.overlap_param_gather, flag, "needs --overlap-param-gather")
        _require(args.virtual_pipeline_model_parallel_size is not None, flag,
                 "only supported with interleaved pipeline parallelism "
                 "(--num-virtual-stages-per-pipeline-rank > 1, as in Megatron-LM)")
        _require(args.save is None and args.load is None, flag,
                 "not supported with distributed checkpointing yet (Megatron-LM's rule; "
                 "--save/--load write and read torch_dist checkpoints)")
    if args.ddp_average_in_collective:
        from megatron_2bw.runtime.device import device_kind

        _require(device_kind(args.cpu) == "cuda", "--ddp-average-in-collective",
                 "needs CUDA (NCCL's ReduceOp.AVG; gloo has no AVG reduction)")
    if args.virtual_pipeline_model_parallel_size is None:
        args.align_param_gather = False  # Megatron-LM: only with virtual pipeline stages
    if args.bf16 and args.grad_reduce_in_bf16:
        args.accumulate_allreduce_grads_in_fp32 = False
    elif args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
