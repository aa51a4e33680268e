"""Every Megatron-LM flag our own parser does not define: accepted with Megatron-LM's names,
types, nargs, choices and defaults, and given one status each (docs/megatron_lm_flags.md).

* ``cpu-noop`` -- a GPU-only feature: one note on rank 0 on the CPU; on CUDA copied into
  megatron-core's TransformerConfig as Megatron-LM copies it (``cuda="config"``/``"te"``), or
  refused;
* ``noop`` -- accepted with one note (deprecated in Megatron-LM itself, or our only behaviour);
* ``refused`` -- a FlagError of one line saying why, unless the flag holds Megatron-LM's
  default (Megatron-LM command lines often spell defaults out).

Flags our parser defines have status ``works``. The flags themselves come from
``megatron_lm_flags_core_v0.16.1.json`` (Megatron-LM's parser at core_v0.16.1, built by
``tools/flag_table.py --from-source``); this file holds only each one's status: its first
matching pattern in :data:`_BY_FLAG`, else its argument group in :data:`_BY_GROUP`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_2bw.flag_types import FlagError

__all__ = ["STATUSES", "REFERENCE_FILE", "Category", "reference", "add_megatron_lm_flags",
           "check_megatron_lm_flags", "cuda_config_fields", "category_of", "status_rows"]

STATUSES = ("works", "cpu-noop", "noop", "refused")
REFERENCE_FILE = Path(__file__).with_name("megatron_lm_flags_core_v0.16.1.json")
_GROUP_TITLE = "Megatron-LM flags megatron-2bw accepts without implementing them " \
               "(docs/megatron_lm_flags.md)"


@dataclass(frozen=True)
class Category:
    """One reason shared by many flags. ``cuda`` (cpu-noop only): what the flag does on CUDA --
    ``"config"`` copied into TransformerConfig, ``"te"`` the same where transformer-engine
    imports, None refused. ``same_as_ours``: values (besides Megatron-LM's default) that are
    megatron-2bw's behaviour already, accepted silently."""

    status: str
    reason: str
    cuda: str | None = None
    same_as_ours: tuple = ()


_C = Category
CATEGORIES = {
    # GPU-only features: no effect on the CPU
    "fusion": _C("cpu-noop", "a CUDA kernel fusion", cuda="config"),
    "default-fusion": _C("cpu-noop", "a CUDA kernel fusion, on by default on CUDA where its "
                         "kernel imports (megatron_2bw/training/fusions.py)", cuda="config"),
    "cuda-setting": _C("cpu-noop", "a CUDA numerics/memory setting", cuda="config"),
    "fp8": _C("cpu-noop", "an FP8/FP4 transformer-engine recipe", cuda="te"),
    "fp8-format": _C("cpu-noop", "an FP8/FP4 transformer-engine recipe, refused under 2bw, "
                     "pipedream and pipemare (transformer-engine's cached low-precision weight "
                     "would be overwritten by the next batch's look-ahead forwards)", cuda="te"),
    "te": _C("cpu-noop", "a transformer-engine option", cuda="te"),
    "comm-overlap": _C("cpu-noop", "a CUDA/NCCL communication optimization (userbuffers, "
                       "NCCL, SHARP, CUDA graphs, streams)"),
    "gpu-memory": _C("cpu-noop", "a CUDA memory profiling/synchronization tool"),
    # accepted, no effect
    "deprecated": _C("noop", "deprecated and ignored by Megatron-LM itself"),
    "ours-already": _C("noop", "megatron-2bw always behaves so"),
    "bert-flag": _C("noop", "a BERT flag (pretrain_bert_2bw.py reads it); GPT ignores it"),
    "backend": _C("noop", "the backend follows the device: gloo on the CPU, NCCL on CUDA",
                  same_as_ours=("gloo", "nccl")),
    "dataloader": _C("noop", "megatron-2bw's loader is Megatron-LM's 'single' sampler",
                     same_as_ours=("single",)),
    "tiktoken": _C("noop", "read only by --tokenizer-type TikTokenizer, which megatron-2bw "
                   "does not offer (it needs the tiktoken package and its vocabulary files)"),
    # refused unless given Megatron-LM's default
    "moe": _C("refused", "a Mixture-of-Experts option megatron-2bw does not implement (flex/"
              "DeepEP dispatch, expert-parallel communication overlap, upcycling, latent "
              "projections, routing replay, legacy grouped GEMM, MoE layer recomputation, "
              "input jitter, forced balancing; docs/moe.md lists what runs)"),
    "context-parallel": _C("refused", "context parallelism needs transformer-engine attention "
                           "on CUDA, which megatron-2bw's schedules do not set up"),
    "pipeline-layout": _C("refused", "megatron-2bw runs no encoder-decoder split, microbatch "
                          "groups other than the pipeline depth, multi-token prediction or "
                          "another pipeline communication backend"),
    "attention-variant": _C("refused", "multi-latent, linear, sparse and windowed attention "
                            "variants are not in megatron-2bw's layer specs"),
    "model-variant": _C("refused", "a model variant megatron-2bw's model builders do not "
                        "implement"),
    "hybrid": _C("refused", "Mamba/hybrid and heterogeneous models are not supported by "
                 "megatron-2bw"),
    "offload": _C("refused", "CPU offloading and FSDP are not supported by megatron-2bw"),
    "optimizer": _C("refused", "an optimizer option megatron-2bw does not implement (Adam, "
                    "Muon and SGD through megatron-core's OptimizerConfig)"),
    "schedule": _C("refused", "a learning-rate or weight-decay schedule option megatron-2bw "
                   "does not implement"),
    "checkpoint": _C("refused", "a checkpoint option megatron-2bw's torch_dist checkpoints do "
                     "not implement"),
    "data": _C("refused", "a data option megatron-2bw's datasets do not implement (use "
               "--data-path with --split)"),
    "tokenizer": _C("refused", "a tokenizer option megatron-2bw's offline tokenizers do not "
                    "implement"),
    "other-workloads": _C("refused", "inference, RL, SFT, retrieval and vision workloads are "
                          "not part of megatron-2bw's pretraining"),
    "resiliency": _C("refused", "NVIDIA's resiliency and telemetry services (fault tolerance, "
                     "in-process restart, straggler detection, autoresume, one-logger, "
                     "rerun engine) are not part of megatron-2bw"),
    "process-groups": _C("refused", "megatron-2bw builds megatron-core's process groups itself "
                         "(gloo on the CPU)"),
    "logging": _C("refused", "a logging option megatron-2bw does not implement"),
    "training": _C("refused", "a training-loop option megatron-2bw does not implement"),
    "legacy-model": _C("refused", "megatron-2bw builds megatron-core models only"),
    "replaced": _C("refused", "Megatron-LM itself refuses it (renamed)"),
}

# (pattern on the flag's first option string, category); the first match wins.
_BY_FLAG = [
    (r"--(moe|num-experts|expert-|overlap-moe|ep-overlap)", "moe"),
    (r"--(context-parallel|hierarchical-context|max-seqlen-per-dp-cp|hybrid-context|cp-comm)",
     "context-parallel"),
    (r"--(fp8|fp4)-format$", "fp8-format"),
    (r"--(fp8|fp4|no-fp8|first-last-layers-bf16|num-layers-at-(start|end)-in-bf16|"
     r"keep-fp8|reuse-grad-buf-for-mxfp8|te-precision-config)", "fp8"),
    (r"--(te-rng-tracker|use-te-activation-func)", "te"),
    (r"--tiktoken", "tiktoken"),
    (r"--no-(masked-softmax|rope|gradient-accumulation)-fusion$", "default-fusion"),
    (r"--(no-(masked-softmax|bias-gelu|bias-swiglu|bias-dropout|rope|gradient-accumulation)-"
     r"fusion|no-clone-scatter-output|use-fused-weighted-squared-relu|use-flash-attn)", "fusion"),
    (r"--(use-cpu-initialization|deterministic-mode|disable-bf16-reduced-precision|"
     r"delay-wgrad|defer-embedding-wgrad|wgrad-deferral)", "cuda-setting"),
    (r"--(no-async-tensor|tp-comm|no-tp-comm|use-ring-exchange|enable-cuda-graph|cuda-graph|"
     r"external-cuda-graph|use-nccl-ub|disable-symmetric|symmetric-ar|use-sharp|sharp-|"
     r"nccl-communicator|high-priority-stream|create-all-gather-group|train-sync-interval|"
     r"disable-jit-fuser|no-gradient-reduce-div-fusion)", "comm-overlap"),
    (r"--(record-memory-history|memory-snapshot-path)", "gpu-memory"),
    (r"--(multi-latent|experimental-attention|dsa-|linear-|q-lora|kv-lora|qk-head-dim|"
     r"qk-pos-emb|v-head-dim|rotary-scaling-factor|mscale|cache-mla|window-|rope-type|"
     r"softmax-type|attention-output-gate)", "attention-variant"),
    (r"--(mtp-|pipeline-model-parallel-comm-backend|"
     r"microbatch-group-size|"
     r"overlap-p2p-communication-warmup|encoder-num-layers|decoder-num-layers)",
     "pipeline-layout"),
    (r"--(is-hybrid|mamba|disable-mamba|hybrid-|heterogeneous|spec)\b", "hybrid"),
    (r"--(cpu-offloading|fine-grained-activation-offloading|offload-modules|"
     r"min-offloaded|optimizer-cpu-offload|optimizer-offload|use-torch-optimizer-for-cpu|"
     r"overlap-cpu-optimizer|no-pin-cpu|init-model-with-meta|data-parallel-sharding|"
     r"outer-dp-sharding|fsdp-|suggested-communication-unit|enable-full-sharding|"
     r"torch-fsdp2|no-strict-fsdp)", "offload"),
    (r"--(sgd-momentum|use-precision-aware|main-grads-dtype|main-params-dtype|"
     r"exp-avg|dump-param-to-param-group|apply-wd-to-qk|no-weight-decay-cond)", "optimizer"),
    (r"--(lr-warmup-init|start-weight-decay|end-weight-decay|weight-decay-incr)",
     "schedule"),
    (r"--(use-mcore-models|use-dist-ckpt|ckpt-fully-parallel-save|"
     r"no-async-tensor-model-parallel-allreduce|onnx-safe)$", "deprecated"),
    (r"--(no-one-logger|disable-msc|no-persist-layer-norm|no-scatter-gather-tensors|"
     r"local-rank|no-barrier-with-level-1|"
     r"exit-signal-handler-for-dataloader|legacy-tokenizer)$", "ours-already"),
    (r"--distributed-backend", "backend"),
    (r"--dataloader-type", "dataloader"),
    (r"--(bert-no-binary-head|mask-prob|short-seq-prob)$", "bert-flag"),
    (r"--(use-legacy-models|no-initialization)$", "legacy-model"),
    (r"--(batch-size|checkpoint-activations|warmup|model-parallel-size|dist-ckpt-format)$",
     "replaced"),
    (r"--(disable-gloo-process-groups|use-tp-pp-dp-mapping|fake-process-group|lazy-mpu-init|"
     r"distributed-timeout-seconds-after-init)", "process-groups"),
    (r"--(flash-decode|mlp-chunks-for-prefill|inference-|batch-invariant|use-kitchen|"
     r"kitchen-|mrope-section|config-logger-dir|enable-experimental|yaml-cfg|sft)",
     "other-workloads"),
    (r"--(relative-attention|use-rope-scaling|rope-scaling-factor|no-rope-freq|quick-geglu|"
     r"glu-linear-offset|activation-func-clamp|rotary-interleaved|qk-l2-norm|qk-clip|"
     r"embedding-init-method-std|init-method-xavier|fp32-residual-connection|"
     r"distribute-saved-activations|recompute-modules|recompute-activations|"
     r"fp16-lm-cross-entropy|data-parallel-random-init|cross-entropy-fusion-impl)",
     "model-variant"),
]
_BY_GROUP = {
    "rl": "other-workloads", "inference": "other-workloads", "biencoder": "other-workloads",
    "vision": "other-workloads", "sft": "other-workloads", "moe": "moe",
    "mla": "attention-variant", "experimental_attention_variant": "attention-variant",
    "heterogeneous architecture": "hybrid", "experimental": "hybrid",
    "straggler": "resiliency", "workload inspector": "resiliency",
    "In-process restart": "resiliency", "ft_package": "resiliency", "rerun engine": "resiliency",
    "one logger": "resiliency", "autoresume": "resiliency", "msc": "resiliency",
    "checkpointing": "checkpoint", "data and dataloader": "data", "tokenizer": "tokenizer",
    "logging": "logging", "training": "training", "validation": "training",
    "distributed": "process-groups", "RNG and initialization": "training",
    "transformer configuration": "model-variant", "network size": "model-variant",
    "regularization": "optimizer", "learning rate and weight decay": "schedule",
    "mixed precision": "fp8", "profiling": "gpu-memory", "Transformer-Engine": "fp8",
}
# Megatron-LM's fusion flags whose dest differs from the TransformerConfig field they set
# (core_transformer_config_from_args: "bias_activation_fusion = bias_gelu_fusion / swiglu").
_CONFIG_FIELD = {"bias_gelu_fusion": "bias_activation_fusion",
                 "bias_swiglu_fusion": "bias_activation_fusion"}


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    """Megatron-LM's parser as recorded by tools/flag_table.py --from-source."""
    return json.loads(REFERENCE_FILE.read_text())


def category_of(entry: dict) -> str | None:
    """The category of one reference entry: by flag pattern, else by argument group."""
    first = entry["flags"][0]
    for pattern, category in _BY_FLAG:
        if re.match(pattern, first):
            return category
    return _BY_GROUP.get(entry["group"])


def _registered(parser: argparse.ArgumentParser) -> list[dict]:
    return getattr(parser, "_megatron_lm_flags", [])


_TYPES = {"int": int, "float": float, "str": str, "bool": bool, None: None}
_GIVEN = "_megatron_lm_flags_given"


class _Recording:
    """An argparse action that also records which option string set its dest (two of
    Megatron-LM's flags may share one), in ``namespace._megatron_lm_flags_given``."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.__dict__.setdefault(_GIVEN, {})[self.dest] = option_string


_RECORDING = {kind: type(action.__name__, (_Recording, action), {}) for kind, action in {
    "store": argparse._StoreAction, "store_true": argparse._StoreTrueAction,
    "store_false": argparse._StoreFalseAction,
    "boolean_optional": argparse.BooleanOptionalAction}.items()}


def _add(group, entry: dict, option_strings: list[str]) -> None:
    """One Megatron-LM flag as Megatron-LM's parser defines it; types of its own (tuples,
    frequency patterns, enums) are read as strings."""
    kind = entry["action"]
    kwargs = dict(dest=entry["dest"], default=_default(entry),
                  action=_RECORDING.get(kind, _RECORDING["store"]))
    if kind == "boolean_optional":
        option_strings = [f for f in option_strings if not f.startswith("--no-")] or \
            option_strings
    elif kind not in ("store_true", "store_false"):
        kwargs.update(type=_TYPES.get(entry["type"], str), nargs=entry["nargs"],
                      choices=entry["choices"])
    group.add_argument(*option_strings, help=argparse.SUPPRESS, **kwargs)


def add_megatron_lm_flags(parser: argparse.ArgumentParser) -> None:
    """Add every flag of Megatron-LM's parser that ``parser`` does not define yet (call it
    last); an alias of a flag we define (``--persistent-save-interval``) joins its dest."""
    group = parser.add_argument_group(_GROUP_TITLE)
    defined = parser._option_string_actions
    added = []
    for entry in reference()["flags"]:
        missing = [flag for flag in entry["flags"] if flag not in defined]
        if not missing:
            continue
        if len(missing) < len(entry["flags"]):  # an alias of ours: same dest, our default
            ours = next(defined[f] for f in entry["flags"] if f in defined)
            group.add_argument(*missing, dest=ours.dest, help=argparse.SUPPRESS,
                               **_alias_kwargs(ours))
            continue
        _add(group, entry, missing)
        added.append(entry)
    parser._megatron_lm_flags = added


def _alias_kwargs(ours: argparse.Action) -> dict:
    if isinstance(ours, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return dict(action="store_const", const=ours.const, default=argparse.SUPPRESS)
    return dict(type=ours.type, nargs=ours.nargs, choices=ours.choices,
                default=argparse.SUPPRESS)


def _default(entry: dict):
    return None if isinstance(entry["default"], dict) else entry["default"]


def _megatron_lm_default(dest: str):
    """The default Megatron-LM's namespace holds for ``dest``: that of its first flag with this
    dest (argparse sets each dest's default once, from the first action that has it)."""
    return next(_default(e) for e in reference()["flags"] if e["dest"] == dest)


def _given(entry: dict, value) -> bool:
    """Whether ``value`` differs from Megatron-LM's default for the flag's dest (a one-item
    list given to an nargs="+" flag equals a scalar default; strings compared as given)."""
    default = _megatron_lm_default(entry["dest"])
    if isinstance(value, list) and len(value) == 1 and not isinstance(default, list):
        value = value[0]
    if value == default or value in CATEGORIES[category_of(entry)].same_as_ours:
        return False
    return not (isinstance(value, str) and value == str(default))


def _te_imports() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


@functools.lru_cache(maxsize=None)
def _transformer_config_fields() -> frozenset:
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    return frozenset(f.name for f in dataclasses.fields(TransformerConfig))


def _config_field(entry: dict) -> str | None:
    """The TransformerConfig field the flag sets in Megatron-LM, or None: its dest when
    TransformerConfig has a field of that name (core_transformer_config_from_args copies
    every such arg), or the field it is renamed to there."""
    if entry["dest"] in _CONFIG_FIELD:
        return _CONFIG_FIELD[entry["dest"]]
    return entry["dest"] if entry["dest"] in _transformer_config_fields() else None


def check_megatron_lm_flags(args: argparse.Namespace, registered: list[dict],
                            on_cuda: bool) -> list[str]:
    """Raise FlagError for the first refused flag given a non-default value; return the notes
    (one line per cpu-noop/noop flag given) for rank 0 to print. On CUDA, a given cpu-noop flag
    that maps to a TransformerConfig field is recorded in ``args.megatron_lm_config_fields``
    (read by :func:`cuda_config_fields`), and refused otherwise."""
    notes, fields = [], {}
    given = vars(args).pop(_GIVEN, {})
    for entry in _one_per_dest(registered, given):
        value = getattr(args, entry["dest"], _default(entry))
        if not _given(entry, value):
            continue
        flag = given.get(entry["dest"], entry["flags"][0])
        category = CATEGORIES[category_of(entry)]
        if category.status == "refused":
            raise FlagError(flag, category.reason)
        if category.status == "noop":
            notes.append(f"note: {flag} has no effect ({category.reason}); ignored")
        elif not on_cuda:
            notes.append(f"note: {flag} has no effect on CPU ({category.reason}); ignored")
        else:
            fields.update(_on_cuda(flag, entry, category, value))
    args.megatron_lm_config_fields = fields
    return notes


def _one_per_dest(registered: list[dict], given: dict) -> list[dict]:
    """One entry per dest: the one whose option string was given, else the first."""
    chosen = {}
    for entry in registered:
        if entry["dest"] not in chosen or given.get(entry["dest"]) in entry["flags"]:
            chosen[entry["dest"]] = entry
    return list(chosen.values())


def _on_cuda(flag: str, entry: dict, category: Category, value) -> dict:
    field = _config_field(entry)
    if category.cuda is None or field is None:
        raise FlagError(flag, f"{category.reason}: megatron-2bw does not implement it on CUDA")
    if category.cuda == "te" and not _te_imports():
        raise FlagError(flag, f"{category.reason}: needs transformer-engine, which does not "
                        "import here")
    return {field: value}


def cuda_config_fields(args: argparse.Namespace) -> dict:
    """TransformerConfig fields set by given cpu-noop flags on CUDA (checked by
    :func:`check_megatron_lm_flags`)."""
    return dict(getattr(args, "megatron_lm_config_fields", {}))


@dataclass(frozen=True)
class Row:
    flag: str
    default: str
    status: str
    note: str


def status_rows(parsers: list[argparse.ArgumentParser]) -> list[Row]:
    """One row per option string of Megatron-LM's parser: works when one of ``parsers`` (the
    entry scripts' parsers: GPT's ``arguments.build_parser()`` and pretrain_bert_2bw.py's)
    defines it, else the registry's status."""
    ours = set()
    for parser in parsers:
        registered = {id(e) for e in _registered(parser)}
        ours |= {flag for entry in reference()["flags"] if id(entry) not in registered
                 for flag in entry["flags"] if flag in parser._option_string_actions}
    rows = []
    for entry in reference()["flags"]:
        default = entry["default"]
        default = default["repr"] if isinstance(default, dict) else json.dumps(default)
        for flag in entry["flags"]:
            if flag in ours:
                rows.append(Row(flag, default, "works", "defined by megatron-2bw's parser"))
                continue
            category = CATEGORIES[category_of(entry)]
            note = category.reason
            if category.status == "cpu-noop":
                note += {"config": "; on CUDA: TransformerConfig." + str(_config_field(entry)),
                         "te": "; on CUDA with transformer-engine: TransformerConfig."
                               + str(_config_field(entry))}.get(category.cuda or "", "")
                if category.cuda is None or _config_field(entry) is None:
                    note += "; refused on CUDA"
            rows.append(Row(flag, default, category.status, note))
    return rows
