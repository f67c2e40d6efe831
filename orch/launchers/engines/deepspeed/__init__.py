"""The DeepSpeed engine (:class:`DeepSpeedEngine`) and what only it needs."""

from orch.launchers.engines.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
