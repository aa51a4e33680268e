"""Megatron-LM's flags and what megatron-2bw does with each: docs/megatron_lm_flags.md.

    python tools/flag_table.py                 # rewrite docs/megatron_lm_flags.md
    python tools/flag_table.py --check         # exit 1 when the checked-in table is stale
    python tools/flag_table.py --from-source /work/.mirror/NVIDIA+Megatron-LM/repo \
        --tag core_v0.16.1                     # rewrite the reference list of Megatron-LM's flags

Invariant: the reference list (``megatron_2bw/megatron_lm_flags_core_v0.16.1.json``) is made by
*building Megatron-LM's own parser* at ``--tag`` (its training arguments modules extracted next
to the installed megatron-core, with two stubs), not by reading its source: every action's
option strings, dest, type, nargs, choices, default and group as argparse holds them. The
table's status comes from our parsers (``works``) and from ``megatron_2bw/megatron_lm_flags.py``.

How the parser is built: docs/megatron_lm_compatibility.md, "Flags".
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_2bw import megatron_lm_flags as registry  # noqa: E402

TABLE = ROOT / "docs" / "megatron_lm_flags.md"
_SOURCES = ("arguments", "argument_utils", "training_config", "common_config",
            "resilience_config")
_UTILS_STUB = "def __getattr__(name):\n    return lambda *args, **kwargs: None\n"


# ---- the reference list: Megatron-LM's parser, built ----------------------------------------

def _extract(source: str, tag: str | None, into: Path) -> None:
    """megatron/training/<_SOURCES>.py from a checkout (no tag) or a git mirror at ``tag``."""
    package = into / "megatron" / "training"
    package.mkdir(parents=True)
    for name in _SOURCES:
        relative = f"megatron/training/{name}.py"
        if tag is None:
            text = (Path(source) / relative).read_text()
        else:
            text = subprocess.run(["git", "-C", source, "show", f"{tag}:{relative}"], check=True,
                                  capture_output=True, text=True).stdout
        (package / f"{name}.py").write_text(text)
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text(_UTILS_STUB)


_ACTIONS = {"_StoreAction": "store", "_StoreTrueAction": "store_true",
            "_StoreFalseAction": "store_false", "_StoreConstAction": "store_const",
            "BooleanOptionalAction": "boolean_optional", "_AppendAction": "append"}


def _plain(value):
    """A JSON value for a default or a choice (enums by name, anything else by repr)."""
    if isinstance(value, enum.Enum):
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, str)) for v in value):
        return list(value)
    return {"repr": repr(value)}


def _type_name(action: argparse.Action) -> str | None:
    if action.type is None:
        return None
    name = getattr(action.type, "__name__", type(action.type).__name__)
    return name if name in ("int", "float", "str", "bool") else f"other:{name}"


def reference_from_source(source: str, tag: str | None) -> dict:
    """Every flag of Megatron-LM's parser at ``tag``, built in a child process (the extracted
    package must not mix with this process's imports)."""
    with tempfile.TemporaryDirectory() as scratch:
        _extract(source, tag, Path(scratch))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([scratch, str(ROOT)]))
        out = subprocess.run([sys.executable, "-W", "ignore", __file__, "--dump-parser",
                              scratch], check=True, capture_output=True, text=True, env=env)
    flags = json.loads(out.stdout)
    return {"megatron_lm": tag or os.path.abspath(source),
            "built_with": "megatron.training.arguments.add_megatron_arguments (see "
                          "tools/flag_table.py)", "flags": flags}


def _dump_parser(scratch: str) -> None:
    """(child process) Megatron-LM's parser's actions as JSON on stdout."""
    import megatron

    megatron.__path__.append(os.path.join(scratch, "megatron"))
    import megatron.training

    megatron.training.__path__[:] = [os.path.join(scratch, "megatron", "training")]
    from megatron.training import arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    flags = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flags.append({
            "flags": list(action.option_strings), "dest": action.dest,
            "action": _ACTIONS.get(type(action).__name__, type(action).__name__),
            "type": _type_name(action), "nargs": action.nargs,
            "choices": None if action.choices is None else [_plain(c) for c in action.choices],
            "default": _plain(action.default), "group": group_of.get(id(action))})
    json.dump(flags, sys.stdout, indent=None)


# ---- the table -----------------------------------------------------------------------------

def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default_text(entry: dict) -> str:
    default = entry["default"]
    if isinstance(default, dict):
        return default["repr"]
    return json.dumps(default)


def our_parsers() -> list[argparse.ArgumentParser]:
    """The entry scripts' parsers: GPT's (``arguments.build_parser()``) and BERT's."""
    import pretrain_bert_2bw
    from megatron_2bw.arguments import build_parser

    return [build_parser(), pretrain_bert_2bw.parser()]


def table() -> str:
    """docs/megatron_lm_flags.md, from the reference list, our parsers and the registry."""
    rows = registry.status_rows(our_parsers())
    counts = {status: 0 for status in registry.STATUSES}
    for row in rows:
        counts[row.status] += 1
    reference = registry.reference()
    lines = [
        "# Megatron-LM's flags in megatron-2bw",
        "",
        f"Every flag of Megatron-LM's parser at {reference['megatron_lm']} "
        f"({len(rows)} flags), generated by `python tools/flag_table.py` from "
        "`megatron_2bw/megatron_lm_flags_core_v0.16.1.json` and "
        "`megatron_2bw/megatron_lm_flags.py`; do not edit by hand.",
        "",
        "Status: **works** (our parser defines it and the run uses it), **cpu-noop** (a GPU "
        "feature: no effect on the CPU, one note; on CUDA it maps to megatron-core's config or "
        "is refused), **noop** (accepted, no effect, one note), **refused** (one error line "
        "unless given Megatron-LM's default).",
        "",
        "| status | flags |",
        "|---|---|",
        *[f"| {status} | {count} |" for status, count in counts.items()],
        "",
        "| flag | Megatron-LM default | status | note |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| `{row.flag}` | `{_cell(row.default)}` | {row.status} | "
                     f"{_cell(row.note)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-source", metavar="MEGATRON_LM",
                        help="a Megatron-LM checkout, or a bare git mirror with --tag")
    parser.add_argument("--tag", default=None, help="git tag of a bare mirror (core_v0.16.1)")
    parser.add_argument("--check", action="store_true",
                        help="compare the checked-in table with a fresh one; exit 1 if stale")
    parser.add_argument("--dump-parser", metavar="SCRATCH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dump_parser:
        _dump_parser(args.dump_parser)
        return 0
    if args.from_source:
        reference = reference_from_source(args.from_source, args.tag)
        registry.REFERENCE_FILE.write_text(json.dumps(reference, indent=1) + "\n")
        print(f"wrote {registry.REFERENCE_FILE} ({len(reference['flags'])} actions)")
        registry.reference.cache_clear()
    text = table()
    if args.check:
        stale = not TABLE.exists() or TABLE.read_text() != text
        print(f"{TABLE} is {'stale: run python tools/flag_table.py' if stale else 'current'}")
        return 1 if stale else 0
    TABLE.parent.mkdir(exist_ok=True)
    TABLE.write_text(text)
    print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
