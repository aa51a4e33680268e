"""Print a schedule's per-stage programs and run them through the simulator's NCCL mode.

    python -m megatron_2bw.schedules 2bw --stages 4 --microbatches 4 --batches 2

One line per stage: actions (``F3v1`` forward of microbatch 3 on weight version 1, ``B3v1``,
``S2`` the step making version 2) and, in braces, each fused send/receive group in the order
the stage issues it (``sa3:1`` send the activation of microbatch 3 to stage 1, ``rg2:1``
receive the gradient of microbatch 2 from stage 1). Then the simulated timeline (unit costs: F 1, B 2) with rendezvous sends, or the
deadlock the simulator found. Exit code 1 on a deadlock or a dependency violation.
"""

from __future__ import annotations

import argparse
import sys

from . import (SCHEDULES, ScheduleError, Costs, format_timeline, pipeline_programs,
               placement_of, simulate)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_2bw.schedules",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("schedule", choices=sorted(SCHEDULES))
    parser.add_argument("--stages", type=int, default=4, help="pipeline depth d")
    parser.add_argument("--microbatches", type=int, default=None, help="m (default: d)")
    parser.add_argument("--batches", type=int, default=2, help="Megatron calls (batches)")
    parser.add_argument("--step-sync", choices=("local", "pipeline"), default="local",
                        help="pipeline: the step waits for every stage (clipping, tied "
                             "embeddings without the deferred step)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    microbatches = args.microbatches or args.stages
    try:
        programs = pipeline_programs(args.schedule, args.stages, microbatches, args.batches)
    except (ValueError, ScheduleError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for stage, program in enumerate(programs):
        print(f"stage {stage}: " + " ".join(map(str, program)))
    try:
        result = simulate(programs, Costs(forward=1.0, backward=2.0), step_sync=args.step_sync,
                          placement=placement_of(args.schedule, args.stages))
    except ScheduleError as error:
        print(f"\nNCCL mode: {error}")
        return 1
    print(f"\nNCCL mode: finishes, makespan {result.makespan:g}, bubble {result.bubble:.1%}, "
          f"peak stash {list(result.peak_stash)}, weight versions {list(result.max_versions)}")
    print(format_timeline(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
