"""The optimizer, learning-rate schedule, gradient clipping and loss scaling of a run, as plain torch objects.

An engine other than DeepSpeed trains with the same optimizer and schedule a DeepSpeed run of the
plan would: both read the run's :class:`orch.plans.optim_settings.OptimSettings`, which DeepSpeed gets
serialized into its JSON, so one set of facts decides them for every engine. DeepSpeed's own
classes are not imported here: only its arithmetic is repeated (the schedule's in
:class:`orch.plans.optim_settings.WarmupCosine`), and a test holds the two equal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from orch.plans.optim_settings import LossScaling, OptimSettings, WarmupCosine

LOSS_SCALE_WINDOW = 1000
"""Overflow-free steps before a dynamic loss scale doubles: DeepSpeed's ``loss_scale_window``
default, which its config leaves as it is."""


def lr_schedule(optimizer: torch.optim.Optimizer, schedule: WarmupCosine) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` stepped once per optimizer step, giving the lr DeepSpeed's engine would.

    DeepSpeed builds its schedule before the first step (lr ratio 0 until it is stepped) and steps it
    after every optimizer step; ``LambdaLR`` evaluates its function at 0 on construction and at
    ``n`` after ``n`` steps, hence the shift by one.
    """
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: schedule.ratio(epoch - 1))


def loss_scaler(scaling: LossScaling, device_type: str):
    """fp16's dynamic loss scaling as DeepSpeed runs it: from the same initial scale
    (``2 ** initial_scale_power``), doubling after the same window of overflow-free steps
    (:data:`LOSS_SCALE_WINDOW`). DeepSpeed's ``hysteresis`` (overflows tolerated before the scale
    halves) has no counterpart: torch halves at the first. A static scale has none either (torch's
    scalers always grow and back off), and :func:`orch.plans.optim_settings.optim_settings` never sets one.

    FSDP2's ``ShardedGradScaler`` agrees on an overflow over every rank, each of which sees only
    its shards of the gradients, so all of them skip the same steps.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if scaling.loss_scale:
        raise ValueError(f"loss_scale={scaling.loss_scale}: a static fp16 loss scale has no torch counterpart; "
                         "use dynamic scaling (loss_scale=0)")
    return ShardedGradScaler(device=device_type, init_scale=2.0 ** scaling.initial_scale_power,
                             growth_interval=LOSS_SCALE_WINDOW)


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: OptimSettings, device_type: str, *,
                    fused: bool = True) -> torch.optim.Optimizer:
    """torch's optimizer for ``optim``, with its fused kernel where the device has one (CUDA, and
    CPU for Adam/AdamW) and its multi-tensor one otherwise or when ``fused`` is false (a loss
    scaler's step hands the fused kernel a scale it cannot take from sharded gradients).

    ``adam`` is torch's ``AdamW`` too: DeepSpeed's ``Adam`` decouples weight decay (its
    ``adam_w_mode`` default). Sharded (DTensor) parameters take the foreach kernels; torch's
    fused Adam accepts them as well.
    """
    import torch

    from orch.plans.spec import OptimizerName

    if optim.adam_family:
        kernel = {"fused": True} if fused and device_type in ("cuda", "cpu") else {"foreach": True}
        return torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                 weight_decay=optim.weight_decay, **kernel)
    if optim.name == OptimizerName.sgd:
        return torch.optim.SGD(params, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay,
                               foreach=True)
    raise ValueError(f"optim.name={optim.name.value!r}: the torch engines know adam, adamw and sgd "
                     "(set optim.name to one of them)")
