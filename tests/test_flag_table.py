"""Every flag of Megatron-LM's parser at core_v0.16.1 (the reference list built from its own
parser by tools/flag_table.py) parses with ours and has one status; refused flags raise one
line, no-op flags print one note; the checked-in table is current. No processes."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from megatron_2bw import megatron_lm_flags as registry
from megatron_2bw.arguments import FlagError, build_parser, parse_args

TINY = ["--cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "4",
        "--global-batch-size", "16", "--mock-data", "--eval-iters", "0", "--lr", "1e-3",
        "--train-iters", "2"]
ENTRIES = registry.reference()["flags"]
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_SETS = {"store_true": True, "store_false": False}


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def _dest_default(dest: str):
    """What Megatron-LM's namespace holds for ``dest`` when no flag sets it: argparse takes the
    default of the first action with that dest (two dests have two flags of different
    defaults)."""
    default = next(e["default"] for e in ENTRIES if e["dest"] == dest)
    return None if isinstance(default, dict) else default


def _value(entry: dict) -> list[str]:
    """Command-line words giving the flag a value other than its dest's Megatron-LM default,
    of the flag's Megatron-LM type."""
    if entry["action"] != "store":
        return []
    default = _dest_default(entry["dest"])
    if entry["choices"]:
        return [next(str(c) for c in entry["choices"] if c != default)]
    if entry["type"] == "bool":  # argparse's bool(): any non-empty word is True
        return ["1"]
    number = default if isinstance(default, (int, float)) else 0
    word = {"int": str(number + 3), "float": str(number + 0.25)}.get(entry["type"], "x7")
    return [word] * (entry["nargs"] if isinstance(entry["nargs"], int) else 1)


def _sets_its_default(entry: dict) -> bool:
    """A store_true/store_false flag whose value is already its dest's default
    (--disable-chunked-prefill: Megatron-LM's --enable-chunked-prefill, added first, gives
    that dest the default True)."""
    return _SETS.get(entry["action"], object()) == _dest_default(entry["dest"])


def _failures(entries: list[dict], check) -> list[str]:
    """'flag: what went wrong' for every entry ``check`` raises on (all of them, not the
    first)."""
    failed = []
    for entry in entries:
        try:
            check(entry)
        except (Exception, pytest.fail.Exception) as error:  # noqa: BLE001  (reported below)
            failed.append(f"{entry['flags'][0]}: {type(error).__name__}: {error}")
    return failed


def test_reference_is_megatron_lms_whole_parser():
    flags = [f for e in ENTRIES for f in e["flags"]]
    assert len(flags) == len(set(flags)) > 650  # ~680 option strings at core_v0.16.1
    assert {"--moe-router-topk", "--fp8-format", "--apply-layernorm-1p"} <= set(flags)


def test_every_flag_parses_and_has_a_status(parser):
    registered = [id(e) for e in parser._megatron_lm_flags]

    def check(entry):
        value = _value(entry)
        if id(entry) not in registered and value and \
                isinstance(entry["default"], (int, float, str)):
            value = [str(entry["default"])]  # our own flags range-check their values
        for flag in entry["flags"]:
            parser.parse_args(TINY + [flag] + value)
        assert registry.category_of(entry) is not None or all(
            f in parser._option_string_actions for f in entry["flags"]), "no status"

    failed = _failures(ENTRIES, check)
    assert not failed, f"{len(failed)} flags:\n" + "\n".join(failed)


def test_table_is_current(capsys):
    """The checked-in table equals a fresh one: `python tools/flag_table.py --check` exits 0
    (its main, run here in-process: a fresh interpreter would re-import megatron-core)."""
    spec = importlib.util.spec_from_file_location("flag_table", os.path.join(
        ROOT, "tools", "flag_table.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--check"]) == 0, capsys.readouterr().out
    rows = registry.status_rows(tool.our_parsers())
    assert len(rows) == sum(len(e["flags"]) for e in ENTRIES)
    assert {r.status for r in rows} == set(registry.STATUSES)


def _registered(parser, status: str) -> list[dict]:
    return [e for e in parser._megatron_lm_flags
            if registry.CATEGORIES[registry.category_of(e)].status == status]


def test_refused_flags_raise_one_line_and_accept_their_default(parser):
    def check(entry):
        flag = entry["flags"][0]
        if _sets_its_default(entry):
            assert parse_args(TINY + [flag], world_size=1, parser=parser).flag_notes == []
            return
        with pytest.raises(FlagError) as error:
            parse_args(TINY + [flag] + _value(entry), world_size=1, parser=parser)
        text = str(error.value)
        assert "\n" not in text and text.startswith(flag + ": "), text
        default = _dest_default(entry["dest"])
        if entry["action"] == "store" and default is not None and \
                not isinstance(default, (dict, list)):
            parse_args(TINY + [flag, str(default)], world_size=1, parser=parser)

    refused = _registered(parser, "refused")
    assert len(refused) > 300
    failed = _failures(refused, check)
    assert not failed, f"{len(failed)} of {len(refused)} refused flags:\n" + "\n".join(failed)


def test_noop_flags_give_one_note(parser):
    def check(entry):
        flag = entry["flags"][0]
        args = parse_args(TINY + [flag] + _value(entry), world_size=1, parser=parser)
        if flag in ("--distributed-backend", "--dataloader-type"):
            assert args.flag_notes == []  # their other values are ours: accepted silently
            return
        assert len(args.flag_notes) == 1, args.flag_notes
        note = args.flag_notes[0]
        assert note.startswith(f"note: {flag} has no effect") and "\n" not in note, note

    noops = _registered(parser, "noop") + _registered(parser, "cpu-noop")
    assert len(noops) > 50
    failed = _failures(noops, check)
    assert not failed, f"{len(failed)} of {len(noops)} noop flags:\n" + "\n".join(failed)


@pytest.mark.parametrize("flag", ["--num-layers", "--hidden-size", "--num-attention-heads",
                                  "--max-position-embeddings", "--seq-length", "--lr"])
def test_required_flags(flag):
    i = TINY.index(flag)
    with pytest.raises(FlagError, match=f"^{flag}: required \\(as in Megatron-LM\\)$"):
        parse_args(TINY[:i] + TINY[i + 2:], world_size=1)


def test_context_parallel_above_one_is_refused():
    parse_args(TINY + ["--context-parallel-size", "1"], world_size=1)
    with pytest.raises(FlagError, match="^--context-parallel-size: context parallelism"):
        parse_args(TINY + ["--context-parallel-size", "2"], world_size=1)


@pytest.mark.parametrize("flags, field", [
    (["--cross-entropy-loss-fusion"], "cross_entropy_loss_fusion"),
    (["--calculate-per-token-loss"], "calculate_per_token_loss"),
    (["--qk-layernorm"], "qk_layernorm"),
    # TransformerConfig turns add_qkv_bias on whenever add_bias_linear is (its default)
    (["--disable-bias-linear", "--add-qkv-bias"], "add_qkv_bias"),
    (["--apply-query-key-layer-scaling"], "apply_query_key_layer_scaling"),
])
def test_works_flag_sets_its_transformer_config_field(flags, field):
    from megatron_2bw.training import build

    base = TINY + flags[:-1]
    off = build.transformer_config(parse_args(base, world_size=1), "cpu")
    on = build.transformer_config(parse_args(base + flags[-1:], world_size=1), "cpu")
    assert getattr(off, field) is False and getattr(on, field) is True


def test_cpu_noop_flag_maps_to_the_config_on_cuda(parser):
    """On CUDA a given fusion flag reaches TransformerConfig as Megatron-LM sets it
    (core_transformer_config_from_args at core_v0.16.1 copies every arg named like a
    TransformerConfig field, and bias_activation_fusion = args.bias_gelu_fusion)."""
    args = parse_args(TINY + ["--no-bias-gelu-fusion", "--no-masked-softmax-fusion"],
                      world_size=1, parser=parser)
    notes = registry.check_megatron_lm_flags(args, parser._megatron_lm_flags, on_cuda=True)
    assert notes == []
    assert registry.cuda_config_fields(args) == {"bias_activation_fusion": False,
                                                 "masked_softmax_fusion": False}
    with pytest.raises(FlagError, match="^--use-nccl-ub: .*does not implement it on CUDA"):
        registry.check_megatron_lm_flags(
            parse_args(TINY + ["--use-nccl-ub"], world_size=1, parser=parser),
            parser._megatron_lm_flags, on_cuda=True)


def test_decoupled_lr_reaches_the_optimizer_config():
    """megatron-core's OptimizerConfig carries --decoupled-lr/--decoupled-min-lr (its
    get_standard_config_overrides gives them to the embedding and output layer)."""
    from megatron.core.optimizer import get_standard_config_overrides, OptimizerConfig

    args = parse_args(TINY + ["--decoupled-lr", "5e-4", "--decoupled-min-lr", "1e-5"],
                      world_size=1)
    config = OptimizerConfig(lr=args.lr, decoupled_lr=args.decoupled_lr,
                             decoupled_min_lr=args.decoupled_min_lr)
    overrides = list(get_standard_config_overrides(config).values())
    assert {"max_lr": 5e-4, "min_lr": 1e-5} in overrides


def test_manual_gc_collects_every_interval():
    """--manual-gc: the collector is off, and gc.collect runs every --manual-gc-interval
    iterations (Megatron-LM's training.py)."""
    import gc
    from unittest import mock

    from megatron_2bw.training.housekeeping import Housekeeping

    args = parse_args(TINY + ["--manual-gc", "--manual-gc-interval", "3"], world_size=1)
    house = Housekeeping(args, 0, "cpu", print)
    try:
        assert not gc.isenabled()
        with mock.patch.object(gc, "collect") as collect:
            for iteration in range(1, 10):
                house.after_iteration(iteration)
        assert collect.call_count == 3  # iterations 3, 6, 9
    finally:
        house.close()
    assert gc.isenabled()


def test_per_token_loss_returns_sum_and_tokens():
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import pretrain_gpt_2bw

    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    total, tokens, report = pretrain_gpt_2bw.loss_func(mask, losses, per_token=True)
    assert float(total) == 7.0 and int(tokens) == 3
    assert float(report["lm loss"]) == pytest.approx(7.0 / 3)
