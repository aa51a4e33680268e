"""Measured numbers the cost model can use instead of closed forms: the data types and their
JSON files, nothing that measures (this module imports no torch and no training code).

    Profile      one transformer layer, the embedding, the head and the optimizer step timed on
                 one device (`measure.measure`), the local link (`links.measure_links`), and
                 the scale to a whole iteration (`accuracy.calibrate`); `plan.py --profile`

Profiles are JSON, named after the device (`tools/profiles/<device name>.json`), and load
anywhere (`Profile.load`), so a profile taken on a GPU node plans on a laptop.

Invariants: a file holds no path of the machine that wrote it; a file that is not such a
profile raises ValueError or TypeError naming the field (`megatron_2bw.cli.reading` turns that
into the tool's one `error:` line).
More: docs/planner.md, "The planner as a library".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .cluster import Link
from .model import ModelSpec

__all__ = ["Sample", "Profile", "JsonFile", "default_profile_path", "device_slug", "PROFILE_DIR",
           "PARTS", "PRECISIONS"]

PROFILE_DIR = Path(__file__).resolve().parents[2] / "tools" / "profiles"
PARTS = ("layer", "embedding", "head")
PRECISIONS = ("fp32", "fp16", "bf16")


def require(condition: bool, where: str, message: str) -> None:
    """A field of a loaded file that is not what the planner can use: ValueError naming it."""
    if not condition:
        raise ValueError(f"{where}: {message}")


def check_count(value, where: str) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, where,
             f"expected an integer >= 1, got {value!r}")


def check_nonneg(value, where: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    require(isinstance(value, (int, float)) and not isinstance(value, bool)
             and math.isfinite(value) and value >= 0, where,
             f"expected a finite number >= 0, got {value!r}")


class JsonFile:
    """Saved as indented JSON with a "format" line; a file of another format is refused."""

    FORMAT = ""

    def to_json(self, folder: str | os.PathLike | None = None) -> dict:
        """The file's content; `folder` is where the file goes (for relative paths)."""
        data = dataclasses.asdict(self)
        if isinstance(getattr(self, "model", None), ModelSpec):
            data["model"] = self.model.to_json()
        return {**data, "format": self.FORMAT}

    @classmethod
    def from_json(cls, data: dict, folder: str | os.PathLike | None = None):
        raise NotImplementedError

    @staticmethod
    def read_fields(data: dict, items: str, read) -> dict:
        """`data` without its "format", its "model" read as a ModelSpec and each entry of its
        list `items` read by `read(entry, where)` (where: "items[i]", for messages)."""
        data = dict(data)
        data.pop("format", None)
        data["model"] = _model_from_json(data.get("model"))
        entries = data.get(items, [])
        require(isinstance(entries, list), items, f"expected a list, got {entries!r}")
        data[items] = [read(entry, f"{items}[{i}]") for i, entry in enumerate(entries)]
        return data

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(path.parent.absolute()), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike):
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds a JSON {type(data).__name__}, not a {cls.FORMAT!r} "
                             "object")
        found = data.pop("format", cls.FORMAT)
        if found != cls.FORMAT:
            raise ValueError(f"{path} holds a {found!r}, not a {cls.FORMAT!r} (a layer profile "
                             "goes with --profile, end-to-end runs with --measured)")
        return cls.from_json(data, Path(path).parent.absolute())


def _model_from_json(data) -> ModelSpec:
    require(isinstance(data, dict), "model", f"expected an object, got {data!r}")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
        check_count(data.get(name), f"model.{name}")
    return ModelSpec(**data)


# ---- layer profile ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One measured part at one (tensor-parallel size, microbatch size, recomputation)."""

    part: str
    """"layer" (one transformer layer), "embedding" (word + position embedding, first stage)
    or "head" (final LayerNorm, output layer and cross entropy, last stage)."""
    tp: int
    """Tensor-parallel size emulated (the part's per-rank shapes)."""
    micro_batch: int
    recompute: bool
    forward_s: float
    backward_s: float
    """Backward time; with recomputation it includes the recomputed forward."""
    activation_bytes: float
    """Bytes autograd keeps from the forward for the backward (parameters excluded)."""

    @classmethod
    def from_json(cls, data, where: str) -> "Sample":
        require(isinstance(data, dict), where, f"expected an object, got {data!r}")
        sample = cls(**data)
        require(sample.part in PARTS, f"{where}.part",
                 f"expected one of {', '.join(PARTS)}, got {sample.part!r}")
        check_count(sample.tp, f"{where}.tp")
        check_count(sample.micro_batch, f"{where}.micro_batch")
        for name in ("forward_s", "backward_s", "activation_bytes"):
            check_nonneg(getattr(sample, name), f"{where}.{name}")
        return sample


@dataclass
class Profile(JsonFile):
    """A layer profile: what `plan.py profile` writes and `plan.py --profile` reads."""

    device: str
    """"cuda" or "cpu"."""
    device_name: str
    precision: str
    model: ModelSpec
    """The sizes measured (h, a, s, f, V); another model is scaled by FLOPs and by the closed-
    form activation bytes."""
    samples: list[Sample] = field(default_factory=list)
    threads: int = 1
    optimizer_fixed_s: float = 0.0
    """Optimizer step (with gradient finalisation and clipping): fixed part ..."""
    optimizer_per_param_s: float = 0.0
    """... plus this per parameter of the stage."""
    orthogonalize_layer_s: float = 0.0
    """Muon's Newton-Schulz iterations on one layer's weight matrices at tp 1 (QKV's parts
    apart; the default bf16 iterations); 0: not measured (the cost model's closed form)."""
    runtime_overhead_bytes: float = 0.0
    """Memory in use before any model exists (on CPU the process's resident set with torch and
    megatron-core loaded; 0 on CUDA, whose allocator statistics start empty)."""
    intra_node_link: Link | None = None
    """Measured between two local processes, when `links.measure_links` ran."""
    compute_scale: float = 1.0
    """A whole training iteration of the profiled model on one device (`accuracy.calibrate`),
    measured, over its prediction from the parts above: the work the parts leave out (data,
    the loss, DDP's gradient hooks, the training loop, the working set of a whole model
    instead of one layer). The cost model multiplies every compute and optimizer time by it."""
    calibration: dict = field(default_factory=dict)
    """What `compute_scale` comes from: the layout, measured and predicted seconds."""
    created: str = ""
    versions: dict = field(default_factory=dict)

    # ---- lookup ---------------------------------------------------------------------------
    def lookup(self, part: str, tp: int, micro_batch: int, recompute: bool) -> Sample | None:
        """The measured sample nearest to (tp, micro_batch, recompute): this tp if it was
        measured, else tp = 1 (the returned sample's `tp` says which); the nearest microbatch
        size, its times and bytes scaled by micro_batch / measured. None when `part` was not
        measured."""
        rc = recompute if part == "layer" else False
        for tp_try in dict.fromkeys((tp, 1)):
            pool = [s for s in self.samples if s.part == part and s.tp == tp_try
                    and s.recompute == rc]
            if not pool:
                continue
            near = min(pool, key=lambda s: (abs(math.log(s.micro_batch / micro_batch)),
                                            -s.micro_batch))
            scale = micro_batch / near.micro_batch
            return dataclasses.replace(
                near, micro_batch=micro_batch, forward_s=near.forward_s * scale,
                backward_s=near.backward_s * scale,
                activation_bytes=near.activation_bytes * scale)
        return None

    def optimizer_step_s(self, params: float) -> float:
        return self.optimizer_fixed_s + self.optimizer_per_param_s * params

    # ---- JSON -----------------------------------------------------------------------------
    FORMAT = "megatron-2bw layer profile v1"

    @classmethod
    def from_json(cls, data: dict, folder: str | os.PathLike | None = None) -> "Profile":
        """The profile in `data`; a field the cost model cannot use raises ValueError."""
        data = cls.read_fields(data, "samples", Sample.from_json)
        if data.get("intra_node_link"):
            data["intra_node_link"] = Link(**data["intra_node_link"])
            require(data["intra_node_link"].bandwidth > 0, "intra_node_link.bandwidth",
                     "must be > 0")
        profile = cls(**data)
        require(profile.device in ("cpu", "cuda"), "device",
                 f"expected 'cpu' or 'cuda', got {profile.device!r}")
        require(profile.precision in PRECISIONS, "precision",
                 f"expected one of {', '.join(PRECISIONS)}, got {profile.precision!r}")
        for name in ("optimizer_fixed_s", "optimizer_per_param_s", "orthogonalize_layer_s",
                     "runtime_overhead_bytes"):
            check_nonneg(getattr(profile, name), name)
        check_nonneg(profile.compute_scale, "compute_scale")
        require(profile.compute_scale > 0, "compute_scale", "must be > 0")
        return profile


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def default_profile_path(device_name: str) -> Path:
    """tools/profiles/<device name>.json"""
    return PROFILE_DIR / f"{device_slug(device_name)}.json"
