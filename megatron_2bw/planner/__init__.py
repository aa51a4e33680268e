"""The planner: which (tensor, pipeline, data)-parallel layout, microbatch size, recomputation
and schedule to train a model with on a cluster, and the flags to launch it.

    from megatron_2bw.planner import ModelSpec, PlanRequest, preset, search, write_plan
    model = ModelSpec("gpt", num_layers=96, hidden_size=12288, num_attention_heads=96,
                      seq_length=2048, vocab_size=51200)
    plan = search(PlanRequest(model, preset("dgx-h100", nodes=128), global_batch_size=1536))
    write_plan(plan, "plan/")

Invariant: the modules depend one way, model -> cost -> search -> flags (cluster and profile
beneath; tests/test_planner_structure.py); the ones that produce the numbers (measure, links,
e2e, accuracy) import that line, never the reverse. The command line is `tools/plan.py`.

The module map and what each holds: docs/planner.md, "The planner as a library".
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
