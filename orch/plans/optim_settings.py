"""The optimizer, learning-rate schedule, gradient clipping and fp16 loss scaling of a run, as one
typed object every training engine reads.

:func:`optim_settings` decides them once, from ``optim``, ``train.steps`` and the plan's precision;
the DeepSpeed engine gets them serialized into its JSON
(:func:`orch.launchers.engines.deepspeed.config.build_ds_config`), the FSDP2 engine builds torch's
optimizer, schedule and scaler from them (:mod:`orch.launchers.engines.fsdp2.torch_optim`). Both
therefore train with the same facts, and neither engine's format is the other's source.
The values are DeepSpeed's where a DeepSpeed run has always used them (its ``WarmupCosineLR``
schedule, its fp16 dynamic scaling), so the two engines stay equal step for step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from orch.plans.resolve import ResolvedPlan
from orch.plans.spec import OptimizerName, OptimSpec, Precision

ADAM_EPS = 1e-8
"""The Adam epsilon every run uses (``optim`` does not expose it)."""


@dataclass(frozen=True, kw_only=True)
class WarmupCosine:
    """DeepSpeed's ``WarmupCosineLR`` (deepspeed/runtime/lr_schedules.py): a warm-up from
    ``warmup_min_ratio`` to the full lr, then a cosine decay to ``cos_min_ratio`` of it."""

    total_num_steps: int
    """Optimizer steps of the whole run; the decay ends there."""
    warmup_num_steps: int
    """Steps of the warm-up (DeepSpeed warms up over at least 2)."""
    warmup_min_ratio: float
    """The lr ratio the warm-up starts from."""
    warmup_type: Literal["linear", "log"]
    """How the warm-up rises."""
    cos_min_ratio: float
    """The lr ratio the decay ends at."""

    def ratio(self, iteration: int) -> float:
        """The lr ratio DeepSpeed gives after ``iteration + 1`` scheduler steps (``-1``: none yet, 0).

        DeepSpeed's arithmetic repeated (a test holds the two equal), including its warm-up over
        at least two steps: with ``warmup_type=linear`` the first two steps run at lr 0.
        """
        if iteration < 0:
            return 0.0
        warmup = max(2, self.warmup_num_steps)
        if iteration < warmup:
            if self.warmup_type == "linear":
                rising = iteration / warmup
            else:
                rising = math.log(iteration + 1) / math.log(warmup)
            return self.warmup_min_ratio + rising * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (iteration - warmup + 1) / max(1, self.total_num_steps - warmup))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


@dataclass(frozen=True, kw_only=True)
class LossScaling:
    """fp16's loss scaling, as DeepSpeed's ``fp16`` section states it."""

    enabled: bool
    """The run trains in fp16 (no other precision scales its loss)."""
    loss_scale: float
    """A static scale; 0 scales dynamically, starting at ``2 ** initial_scale_power``."""
    initial_scale_power: int
    """The dynamic scale starts at 2 to this power, and halves at an overflow."""


@dataclass(frozen=True, kw_only=True)
class OptimSettings:
    """What every engine's optimizer step needs: the optimizer and its hyper-parameters, the lr
    schedule, gradient clipping and loss scaling."""

    name: OptimizerName
    """The optimizer (``adam`` decouples weight decay as ``adamw`` does: DeepSpeed's ``adam_w_mode``
    default, which no run changes)."""
    lr: float
    """The peak learning rate, which the schedule scales."""
    weight_decay: float
    betas: tuple[float, float]
    """Adam's and AdamW's moment decay rates (unused by SGD)."""
    eps: float
    """Adam's and AdamW's denominator term (unused by SGD)."""
    momentum: float
    """SGD's momentum (0: no momentum buffer; unused by Adam)."""
    schedule: WarmupCosine
    grad_clip: float
    """The global gradient-norm limit; 0 clips nothing."""
    loss_scaling: LossScaling

    @property
    def adam_family(self) -> bool:
        """Adam or AdamW (they take betas and eps; SGD takes momentum)."""
        return self.name in (OptimizerName.adam, OptimizerName.adamw)

    def hyperparameters(self) -> dict[str, object]:
        """The optimizer's own hyper-parameters as plain values: betas and eps for Adam, momentum
        for SGD (DeepSpeed's ``optimizer.params`` and the tracked ``optimizer`` alike)."""
        values: dict[str, object] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.adam_family:
            values.update(betas=list(self.betas), eps=self.eps)
        else:
            values["momentum"] = self.momentum
        return values

    def as_dict(self) -> dict[str, object]:
        """Plain values for tracking (``config/optimizer.json``)."""
        return {
            "optimizer": {"name": self.name.value, **self.hyperparameters()},
            "schedule": {"type": "warmup_cosine", **dataclasses.asdict(self.schedule)},
            "grad_clip": self.grad_clip,
            "loss_scaling": dataclasses.asdict(self.loss_scaling),
        }


def optim_settings(plan: ResolvedPlan, optim: OptimSpec, total_steps: int) -> OptimSettings:
    """The settings of a run of ``total_steps`` optimizer steps with ``optim`` (already checked by
    :mod:`orch.plans.validate`) under ``plan``.

    The warm-up runs linearly from 0 over ``optim.warmup_steps`` (at most the run, at least one
    step); the cosine decays to ``optim.min_lr_ratio`` at the run's last step. fp16 scales its
    loss dynamically from 2**16, DeepSpeed's default.
    """
    return OptimSettings(
        name=optim.name,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=tuple(optim.betas),
        eps=ADAM_EPS,
        momentum=optim.momentum,
        schedule=WarmupCosine(total_num_steps=max(total_steps, 1),
                              warmup_num_steps=max(min(optim.warmup_steps, total_steps), 1),
                              warmup_min_ratio=0.0, warmup_type="linear", cos_min_ratio=optim.min_lr_ratio),
        grad_clip=optim.grad_clip,
        loss_scaling=LossScaling(enabled=plan.precision == Precision.fp16, loss_scale=0, initial_scale_power=16),
    )
