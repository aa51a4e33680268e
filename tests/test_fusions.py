"""The masked-softmax, RoPE and gradient-accumulation fusions: Megatron-LM's defaults and flags
on CUDA, off on the CPU, off (one note each) where a kernel does not import or the schedule
traverses a backward twice.

References: Megatron-LM's parser at core_v0.16.1 (megatron/training/arguments.py):
--no-masked-softmax-fusion, --no-rope-fusion, --no-gradient-accumulation-fusion are store_false
with default True (on unless given), and ``validate_args`` sets ``apply_rope_fusion = False``
when ``position_embedding_type != 'rope'``. megatron-core 0.16.1 raises where a fusion is on and
its kernel is missing (TransformerConfig: "apply_rope_fusion is not available"; ColumnParallel-
Linear: fused_weight_gradient_mlp_cuda "module is not found").
"""

from __future__ import annotations

import pytest

from megatron_2bw.arguments import parse_args
from megatron_2bw.training import build
from megatron_2bw.training.fusions import FusionKernels, fusion_fields

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--train-iters", "1", "--lr", "1e-3", "--mock-data"]
ROPE = ["--position-embedding-type", "rope"]
ALL = FusionKernels(masked_softmax=True, rope=True, gradient_accumulation=True)
NONE = FusionKernels(masked_softmax=False, rope=False, gradient_accumulation=False)
FIELDS = ("masked_softmax_fusion", "apply_rope_fusion", "gradient_accumulation_fusion")


def _fields(flags: list[str], device: str, kernels: FusionKernels):
    args = parse_args([*TINY, *flags], world_size=1)
    fields, notes = fusion_fields(args, device, kernels)
    return tuple(fields[f] for f in FIELDS), notes


@pytest.mark.parametrize("flags, device, kernels, expected", [
    (ROPE, "cpu", ALL, (False, False, False)),  # CUDA kernels: never on the CPU
    ([], "cuda", ALL, (True, False, True)),  # Megatron-LM: rope fusion only with rope
    (ROPE, "cuda", ALL, (True, True, True)),  # Megatron-LM's defaults
    ([*ROPE, "--no-masked-softmax-fusion"], "cuda", ALL, (False, True, True)),
    ([*ROPE, "--no-rope-fusion"], "cuda", ALL, (True, False, True)),
    ([*ROPE, "--no-gradient-accumulation-fusion"], "cuda", ALL, (True, True, False)),
    ([*ROPE, "--no-masked-softmax-fusion", "--no-rope-fusion",
      "--no-gradient-accumulation-fusion"], "cuda", NONE, (False, False, False)),
])
def test_fusions_follow_megatron_lm_flags_on_cuda(flags, device, kernels, expected):
    fields, notes = _fields(flags, device, kernels)
    assert fields == expected
    assert notes == []  # nothing asked for is off for want of a kernel


@pytest.mark.parametrize("missing, field, flag", [
    ("masked_softmax", "masked_softmax_fusion", "--no-masked-softmax-fusion"),
    ("rope", "apply_rope_fusion", "--no-rope-fusion"),
    ("gradient_accumulation", "gradient_accumulation_fusion",
     "--no-gradient-accumulation-fusion"),
])
def test_a_fusion_whose_kernel_does_not_import_is_off_with_one_note(missing, field, flag):
    kernels = FusionKernels(**{**vars(ALL), missing: False})
    fields, notes = _fields(ROPE, "cuda", kernels)
    assert fields == tuple(f != field for f in FIELDS)
    assert len(notes) == 1 and notes[0].startswith(f" {field} off (") and flag in notes[0], notes


def test_gradient_accumulation_fusion_stays_on_under_a_split_backward():
    """zb-h1's W runs each weight-gradient GEMM once, with the fused kernel where it is on
    (schedules/wgrad.py), so the fusion follows Megatron-LM's flag as under flush."""
    assert _fields([*ROPE, "--pipeline-schedule", "zb-h1"], "cuda", ALL) == ((True, True, True), [])
    assert _fields([*ROPE, "--pipeline-schedule", "zb-h1",
                    "--no-gradient-accumulation-fusion"], "cuda", ALL) == ((True, True, False), [])


def test_this_machine_probes_no_cuda_kernels():
    """No apex, no transformer-engine here: what megatron-core itself checks says so."""
    assert FusionKernels.probe() == NONE


def test_transformer_config_takes_the_fusions_on_cuda(monkeypatch, capsys):
    """TransformerConfig as built for a CUDA process: the fusions whose kernels import are on
    (kernels stood in for by the probe's answer; RoPE's is not claimed, as TransformerConfig
    itself imports it), the one that does not is off with its note, printed once."""
    monkeypatch.setattr(FusionKernels, "probe", classmethod(lambda cls: FusionKernels(
        masked_softmax=True, rope=False, gradient_accumulation=True)))
    monkeypatch.setattr(build, "_noted", set(), raising=False)
    args = parse_args([*TINY, *ROPE], world_size=1)
    config = build.transformer_config(args, "cuda")
    assert (config.masked_softmax_fusion, config.apply_rope_fusion,
            config.gradient_accumulation_fusion) == (True, False, True)
    build.transformer_config(args, "cuda")
    out = capsys.readouterr().out
    assert out.count(" apply_rope_fusion off (") == 1, out
    cpu = build.transformer_config(args, "cpu")
    assert not (cpu.masked_softmax_fusion or cpu.apply_rope_fusion
                or cpu.gradient_accumulation_fusion)
