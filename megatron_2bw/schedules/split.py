"""How many transformer layers each virtual stage holds: Megatron-LM's layout flags as data.

A :class:`LayerSplit` lists the layers of every virtual stage in model order (virtual stage 0
embeds, the last one holds the final norm, the output layer and the loss); a `Placement` says
which rank and chunk holds each virtual stage, so one split serves the loop and the V alike.

    split = layer_split(LayoutFlags(num_layers=8, depth=2, last=1))   # (7, 1)
    split.layout(), split.offset(1), split.count(1)                    # "E,t*7|t,L", 7, 1

Invariant: :func:`layer_split` reads the flags with megatron-core 0.16.1's semantics
(``get_num_layers_to_build``, ``get_transformer_layer_offset``, ``TransformerConfig``'s and
Megatron-LM's checks) and raises :class:`LayoutError` (the flag to fix, one line) where they do
not add up. docs/schedules.md ("Uneven layouts") says what each flag means.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .actions import Placement

__all__ = ["LayerSplit", "LayoutFlags", "LayoutError", "layer_split", "parse_layout",
           "layout_stages"]

FIRST = "--decoder-first-pipeline-num-layers"
LAST = "--decoder-last-pipeline-num-layers"
EMBEDDING = "--account-for-embedding-in-pipeline-split"
LOSS = "--account-for-loss-in-pipeline-split"
LAYOUT = "--pipeline-model-parallel-layout"
PER_CHUNK = "--num-layers-per-virtual-pipeline-stage"
CHUNKS = "--num-virtual-stages-per-pipeline-rank"


class LayoutError(ValueError):
    """A layout that does not add up: ``flag`` to fix, ``message`` one line saying why."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag, self.message = flag, message


@dataclass(frozen=True)
class LayerSplit:
    """Transformer layers per virtual stage in model order; `depth` pipeline ranks hold
    ``len(layers) // depth`` chunks each."""

    layers: tuple[int, ...]
    depth: int

    def __post_init__(self) -> None:
        if self.depth < 1 or not self.layers or len(self.layers) % self.depth:
            raise ValueError(f"{len(self.layers)} virtual stages do not fill {self.depth} "
                             f"pipeline ranks")
        if any(n < 0 for n in self.layers):
            raise ValueError(f"negative layer count in {self.layers}")

    @classmethod
    def even(cls, num_layers: int, depth: int, chunks: int = 1) -> "LayerSplit":
        """megatron-core's default: L / (d V) layers on every virtual stage."""
        stages = depth * chunks
        if num_layers % stages:
            raise ValueError(f"{num_layers} layers do not split evenly over {stages} stages")
        return cls((num_layers // stages,) * stages, depth)

    @property
    def chunks(self) -> int:
        return len(self.layers) // self.depth

    @property
    def num_layers(self) -> int:
        return sum(self.layers)

    @property
    def is_even(self) -> bool:
        return len(set(self.layers)) == 1

    def count(self, virtual: int) -> int:
        """Layers of virtual stage `virtual`."""
        return self.layers[virtual]

    def offset(self, virtual: int) -> int:
        """Global number (0-based) of virtual stage `virtual`'s first layer: the layers of the
        virtual stages before it in model order."""
        return sum(self.layers[:virtual])

    def of_rank(self, placement: Placement, rank: int) -> tuple[int, ...]:
        """Layers of each of `rank`'s chunks under `placement`."""
        return tuple(self.layers[placement.virtual(rank, c)] for c in range(placement.chunks))

    def layout(self) -> str:
        """Megatron-LM's ``--pipeline-model-parallel-layout`` string of this split (virtual
        stages in model order, "E" the embedding, "t" a layer, "L" the loss; commas are
        cosmetic): (3, 1) -> "E,t*3|t,L"."""
        stages = []
        last = len(self.layers) - 1
        for v, n in enumerate(self.layers):
            parts = (["E"] if v == 0 else []) + ([f"t*{n}"] if n > 3 else ["t" * n] if n else []) \
                + (["L"] if v == last else [])
            stages.append(",".join(parts))
        return "|".join(stages)

    def __str__(self) -> str:
        return "|".join(map(str, self.layers))


@dataclass(frozen=True)
class LayoutFlags:
    """Megatron-LM's flags that split the layers (None / False: not given)."""

    num_layers: int
    depth: int
    chunks: int | None = None
    """--num-virtual-stages-per-pipeline-rank."""
    layers_per_chunk: int | None = None
    """--num-layers-per-virtual-pipeline-stage."""
    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False
    layout: str | None = None
    shape: str = "loop"
    """The schedule's placement: "loop", or "v" (zb-v, dualpipev: two chunks per rank)."""

    @property
    def uneven(self) -> bool:
        """Whether any flag moves layers off megatron-core's even split."""
        return (self.first is not None or self.last is not None or self.embedding
                or self.loss or self.layout is not None)


def layer_split(flags: LayoutFlags) -> LayerSplit:
    """The split Megatron-LM's flags give (megatron-core 0.16.1's semantics); LayoutError where
    they do not add up or megatron-core refuses them. V from the flags (the layout string's
    stage count under --pipeline-model-parallel-layout; 2 under the V placement)."""
    f, d = flags, flags.depth
    if f.layout is not None:
        for flag, given in ((FIRST, f.first is not None), (LAST, f.last is not None),
                            (EMBEDDING, f.embedding), (LOSS, f.loss), (CHUNKS, f.chunks),
                            (PER_CHUNK, f.layers_per_chunk)):
            if given:
                raise LayoutError(flag, f"not with {LAYOUT}, which places every layer itself "
                                        "(as in Megatron-LM)")
        return parse_layout(f.layout, d, f.num_layers, f.shape)
    if f.first is not None or f.last is not None:
        if f.embedding or f.loss:
            raise LayoutError(EMBEDDING if f.embedding else LOSS,
                              f"not with {FIRST}/{LAST} (megatron-core refuses the two "
                              "kinds of uneven split together)")
        if f.shape == "v":
            raise LayoutError(FIRST if f.first is not None else LAST,
                              "counts the loop's first and last rank, but under the V rank 0 "
                              f"holds the first and the last stage: give {LAYOUT} (virtual "
                              "stages in model order)")
        if f.layers_per_chunk is not None:
            raise LayoutError(PER_CHUNK, f"not with {FIRST}/{LAST}: give the virtual stages "
                                         f"per rank with {CHUNKS} (as in Megatron-LM)")
        return _first_last(f)
    chunks = 2 if f.shape == "v" else _chunks(f)
    extra = int(f.embedding) + int(f.loss)
    units = f.num_layers + extra
    if units % (d * chunks):
        flag = (EMBEDDING if f.embedding else LOSS) if extra else "--num-layers"
        counted = (f"{f.num_layers} layers + {extra} (embedding/loss counted as layers) = "
                   f"{units}" if extra else f"{units} layers")
        over = (f"the V's 2 x {d} pipeline stages = {2 * d} model chunks" if f.shape == "v"
                else f"{d} pipeline stages x {chunks} virtual stages = {d} x {chunks} = "
                     f"{d * chunks} model chunks" if chunks > 1 else f"{d} pipeline stages")
        raise LayoutError(flag, f"{counted} do not split evenly over {over}")
    per = units // (d * chunks)
    layers = [per] * (d * chunks)
    layers[0] -= int(f.embedding)
    layers[-1] -= int(f.loss)
    if min(layers) < 0:  # one layer-unit per virtual stage, two of them taken at one end
        raise LayoutError(EMBEDDING, f"{units} layer-units over {d * chunks} virtual stages "
                                     "leave the embedding's and the loss's stage no room")
    return LayerSplit(tuple(layers), d)


def _chunks(f: LayoutFlags) -> int:
    """V in the loop from --num-virtual-stages-per-pipeline-rank or, as Megatron-LM derives
    it, (L + embedding + loss) / d / --num-layers-per-virtual-pipeline-stage."""
    if f.layers_per_chunk is None:
        return f.chunks or 1
    units = f.num_layers + int(f.embedding) + int(f.loss)
    if units % f.depth:
        raise LayoutError("--num-layers", f"{units} layers do not split evenly over "
                                          f"{f.depth} pipeline stages")
    if (units // f.depth) % f.layers_per_chunk:
        raise LayoutError(PER_CHUNK, f"{units} layers / {f.depth} pipeline stages = "
                                     f"{units // f.depth} layers per stage are not divisible "
                                     f"by {f.layers_per_chunk} layers per virtual stage")
    return units // f.depth // f.layers_per_chunk


def _first_last(f: LayoutFlags) -> LayerSplit:
    """--decoder-first/last-pipeline-num-layers: the first (last) rank holds that many layers,
    the ranks between share the rest evenly; each rank's layers split evenly over its V
    chunks (TransformerConfig's checks, get_num_layers_to_build)."""
    d, V = f.depth, f.chunks or 1
    given = [(flag, n) for flag, n in ((FIRST, f.first), (LAST, f.last)) if n is not None]
    for flag, n in given:
        if n <= 0:
            raise LayoutError(flag, f"must be > 0, got {n} (megatron-core builds no empty "
                                    "first or last stage; --pipeline-model-parallel-layout "
                                    "can give one)")
        if n % V:
            raise LayoutError(flag, f"{n} layers do not split over {V} virtual stages per "
                                    "pipeline rank")
    if d == 1:
        bad = [(flag, n) for flag, n in given if n != f.num_layers]
        if bad or len(given) > 1:
            flag, n = (bad or given)[-1]
            raise LayoutError(flag, f"one pipeline stage is both first and last and holds all "
                                    f"{f.num_layers} layers, not {n}")
        return LayerSplit((f.num_layers,), 1)
    middle = f.num_layers - sum(n for _, n in given)
    stages = d - len(given)
    said = " + ".join(f"{n} ({flag[2:].split('-')[1]})" for flag, n in given)
    if middle < 0 or bool(middle) != bool(stages):
        raise LayoutError(given[-1][0], f"{f.num_layers} layers - {said} leave {middle} for "
                                        f"the {stages} pipeline stage(s) between")
    if V > 1 and not stages:  # get_transformer_layer_offset's "// middle_pipeline_stages"
        raise LayoutError(given[-1][0], f"with {V} virtual stages and no pipeline stage "
                                        "between the first and the last, megatron-core 0.16.1 "
                                        "cannot number the layers (its offset divides by the 0 "
                                        f"stages between): give {LAYOUT}")
    if stages and (middle % stages or (middle // stages) % V):
        raise LayoutError(given[-1][0], f"the {middle} layers left for the {stages} middle "
                                        f"pipeline stages do not split evenly over them and "
                                        f"their {V} virtual stages each")
    per_rank = [middle // stages if stages else 0] * d
    if f.first is not None:
        per_rank[0] = f.first
    if f.last is not None:
        per_rank[-1] = f.last
    return LayerSplit(tuple(per_rank[i] // V for _ in range(V) for i in range(d)), d)


_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


def layout_stages(text: str) -> int:
    """Stages (d V) a ``--pipeline-model-parallel-layout`` string holds."""
    return len(_expand(text).split("|"))


def _expand(text: str) -> str:
    """The layout string with its repeats unrolled and its commas dropped."""
    expanded = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):  # megatron-core's two passes
        expanded = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), expanded)
    return expanded


def parse_layout(text: str, depth: int, num_layers: int, shape: str = "loop") -> LayerSplit:
    """``--pipeline-model-parallel-layout``: virtual stages in model order separated by "|",
    "E" the embedding, "t" a layer, "L" the loss, "x*n" and "(...)*n" repeats, commas
    cosmetic (megatron-core's ``PipelineParallelLayerLayout.parse_str_to_list``). Its stage
    count is d V (V = 2 under the V placement); "E" opens the first stage and "L" closes the
    last, once each; the "t"s number --num-layers."""
    expanded = _expand(text)
    stages = expanded.split("|")
    bad = sorted({c for c in expanded if c not in _CHARS and c != "|"})
    if bad:
        raise LayoutError(LAYOUT, f"unknown layer character {bad[0]!r} in {text!r}: E "
                                  "(embedding), t (transformer layer), L (loss)")
    if "m" in expanded:
        raise LayoutError(LAYOUT, "m (a multi-token prediction layer): megatron-2bw builds no "
                                  "MTP layers")
    if len(stages) % depth:
        raise LayoutError(LAYOUT, f"{len(stages)} stages in {text!r} are not a multiple of "
                                  f"{depth} pipeline stages")
    if shape == "v" and len(stages) != 2 * depth:
        raise LayoutError(LAYOUT, f"the V placement holds 2 x {depth} = {2 * depth} virtual "
                                  f"stages, {text!r} has {len(stages)}")
    if expanded.count("E") != 1 or not stages[0].startswith("E"):
        raise LayoutError(LAYOUT, f"{text!r}: the embedding E must open the first stage, "
                                  "once (megatron-core embeds on the first virtual stage)")
    if expanded.count("L") != 1 or not stages[-1].endswith("L"):
        raise LayoutError(LAYOUT, f"{text!r}: the loss L must close the last stage, once "
                                  "(megatron-core computes it on the last virtual stage)")
    layers = tuple(stage.count("t") for stage in stages)
    if sum(layers) != num_layers:
        raise LayoutError(LAYOUT, f"{text!r} places {sum(layers)} transformer layers, "
                                  f"--num-layers is {num_layers}")
    return LayerSplit(layers, depth)
