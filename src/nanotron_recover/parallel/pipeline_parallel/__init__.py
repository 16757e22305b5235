"""Pipeline parallelism: schedules and the point-to-point transfers they use."""

from .engine import AllForwardAllBackward, OneForwardOneBackward, PipelineEngine, build_engine

__all__ = ["AllForwardAllBackward", "OneForwardOneBackward", "PipelineEngine", "build_engine"]
