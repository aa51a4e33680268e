"""megatron-2bw: PipeDream-2BW and pipeline baselines inside megatron-core."""

__version__ = "0.1.0"
