"""The planner: which (tensor, pipeline, data)-parallel layout, microbatch size, recomputation
and schedule to train a model with on a cluster, and the flags to launch it.

    from megatron_2bw.planner import ModelSpec, PlanRequest, preset, search, write_plan
    model = ModelSpec("gpt", num_layers=96, hidden_size=12288, num_attention_heads=96,
                      seq_length=2048, vocab_size=51200)
    plan = search(PlanRequest(model, preset("dgx-h100", nodes=128), global_batch_size=1536))
    write_plan(plan, "plan/")

    model.py    parameters, FLOPs and activation bytes per layer
    cluster.py  devices per node, memory, links; presets
    profile.py  measured numbers as data: layer profiles (JSON files)
    cost.py     memory and time per iteration of a layout
    search.py   enumerate, filter, rank
    flags.py    plan.json, rejected.csv, flags, torchrun and Slurm scripts

They depend one way, model -> cost -> search -> flags (tests/test_planner_structure.py).
Beside them, the modules that produce the numbers (they import the line, never the reverse):

    measure.py   time one layer, the embedding, the head, the optimizer step (torch)
    links.py     time all-reduces between two local processes
    e2e.py       train whole layouts for a few iterations, read their logs; each run
                 holds its Layout (`E2EProfile`, JSON files)
    accuracy.py  predicted vs measured, and the calibration of a layer profile

The command line is `tools/plan.py`.
"""

from .cluster import GiB, PRESETS, Cluster, Link, preset
from .cost import CostModel, Layout, MemoryEstimate, StageMemory, TimeEstimate
from .e2e import E2EProfile
from .flags import launch_flags, parse_for_validation, write_plan
from .model import ModelSpec
from .profile import Profile
from .search import ALL_SCHEDULES, Candidate, Plan, PlanRequest, Rejection, search

__all__ = [
    "ModelSpec", "Cluster", "Link", "PRESETS", "preset", "GiB", "Profile", "E2EProfile",
    "CostModel", "Layout", "MemoryEstimate", "StageMemory", "TimeEstimate", "PlanRequest",
    "Candidate", "Rejection", "Plan", "search", "ALL_SCHEDULES", "launch_flags",
    "parse_for_validation", "write_plan",
]
