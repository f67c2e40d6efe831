"""The optimizer, learning-rate schedule and gradient clipping of a run, as plain torch objects.

An engine other than DeepSpeed trains with the same optimizer and schedule a DeepSpeed run of the
plan would: both are read from the run's DeepSpeed config sections (``optimizer``,
``scheduler``, ``gradient_clipping``, written by :func:`launchers.engines.deepspeed.config.build_ds_config` from
the run's optim settings), so one set of facts decides them for every engine. DeepSpeed's own
classes are not imported here: only its arithmetic is repeated, and a test holds the two equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch


@dataclass(frozen=True, kw_only=True)
class WarmupCosine:
    """DeepSpeed's ``WarmupCosineLR`` (deepspeed/runtime/lr_schedules.py) as a ratio of the base lr."""

    total_num_steps: int
    warmup_num_steps: int
    warmup_min_ratio: float = 0.0
    cos_min_ratio: float = 0.0001
    warmup_type: str = "log"

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> WarmupCosine:
        """From a DeepSpeed config's ``scheduler`` section; only ``WarmupCosineLR`` is written by
        :func:`launchers.engines.deepspeed.config.build_ds_config`, so any other type is refused."""
        if section.get("type") != "WarmupCosineLR":
            raise ValueError(f"scheduler type {section.get('type')!r}: only WarmupCosineLR has a torch counterpart "
                             "here (launchers.engines.fsdp2.torch_optim)")
        params = section.get("params", {})
        return cls(total_num_steps=int(params["total_num_steps"]),
                   warmup_num_steps=int(params.get("warmup_num_steps", 1000)),
                   warmup_min_ratio=float(params.get("warmup_min_ratio", 0.0)),
                   cos_min_ratio=float(params.get("cos_min_ratio", 0.0001)),
                   warmup_type=str(params.get("warmup_type", "log")))

    def ratio(self, iteration: int) -> float:
        """The lr ratio DeepSpeed gives after ``iteration + 1`` scheduler steps (``-1``: none yet, 0)."""
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


def lr_schedule(optimizer: torch.optim.Optimizer, section: dict[str, Any]) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` stepped once per optimizer step, giving the lr DeepSpeed's engine would.

    DeepSpeed builds its schedule before the first step (lr ratio 0 until it is stepped) and steps it
    after every optimizer step; ``LambdaLR`` evaluates its function at 0 on construction and at
    ``n`` after ``n`` steps, hence the shift by one.
    """
    import torch

    schedule = WarmupCosine.from_section(section)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: schedule.ratio(epoch - 1))


def gradient_clip(ds_config: dict[str, Any]) -> float:
    """The global gradient-norm limit (0: none), DeepSpeed's ``gradient_clipping``."""
    return float(ds_config.get("gradient_clipping", 0.0) or 0.0)


def loss_scaler(ds_config: dict[str, Any], device_type: str):
    """fp16's dynamic loss scaling, from DeepSpeed's ``fp16`` section: the same initial scale
    (``2 ** initial_scale_power``) and window of overflow-free steps before it doubles
    (``loss_scale_window``, 1000 by default). DeepSpeed's ``hysteresis`` (overflows tolerated
    before the scale halves) has no counterpart: torch halves at the first.

    FSDP2's ``ShardedGradScaler`` agrees on an overflow over every rank, each of which sees only
    its shards of the gradients, so all of them skip the same steps.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    section = ds_config.get("fp16", {})
    if section.get("loss_scale", 0):
        return ShardedGradScaler(device=device_type, init_scale=float(section["loss_scale"]), growth_factor=1.0,
                                 backoff_factor=1.0)
    return ShardedGradScaler(device=device_type, init_scale=2.0 ** section.get("initial_scale_power", 16),
                             growth_interval=int(section.get("loss_scale_window", 1000)))


def build_optimizer(params: Iterable[torch.nn.Parameter], section: dict[str, Any], device_type: str, *,
                    fused: bool = True) -> torch.optim.Optimizer:
    """torch's optimizer for a DeepSpeed ``optimizer`` section, with its fused kernel where the
    device has one (CUDA, and CPU for Adam/AdamW) and its multi-tensor one otherwise or when
    ``fused`` is false (a loss scaler's step hands the fused kernel a scale it cannot take from
    sharded gradients).

    DeepSpeed's ``Adam`` decouples weight decay unless ``adam_w_mode`` is false (its
    ``ADAM_W_MODE_DEFAULT``), so it is torch's ``AdamW`` here too. Sharded (DTensor) parameters
    take the foreach kernels; torch's fused Adam accepts them as well.
    """
    import torch

    kind = section.get("type")
    given = dict(section.get("params", {}))
    given.pop("torch_adam", None)
    given.pop("fused", None)
    if kind in ("Adam", "AdamW"):
        decoupled = kind == "AdamW" or given.pop("adam_w_mode", True)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        options = {"lr": given["lr"], "betas": tuple(given.get("betas", (0.9, 0.999))),
                   "eps": given.get("eps", 1e-8), "weight_decay": given.get("weight_decay", 0.0)}
        kernel = {"fused": True} if fused and device_type in ("cuda", "cpu") else {"foreach": True}
        return cls(params, **options, **kernel)
    if kind == "SGD":
        return torch.optim.SGD(params, lr=given["lr"], momentum=given.get("momentum", 0.0),
                               weight_decay=given.get("weight_decay", 0.0), foreach=True)
    raise ValueError(f"optimizer type {kind!r}: the torch engines know Adam, AdamW and SGD "
                     "(set optim.name to adam, adamw or sgd)")

