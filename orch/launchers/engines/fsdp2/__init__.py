"""PyTorch FSDP2's engine (:class:`FSDP2Engine`): ``fully_shard`` per repeated block, DTensor tensor
parallelism, torch's optimizers and ``torch.distributed.checkpoint``."""

from orch.launchers.engines.fsdp2.engine import FSDP2Engine

__all__ = ["FSDP2Engine"]
