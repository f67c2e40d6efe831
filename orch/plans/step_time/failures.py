"""What failures cost a training run, and the checkpoint interval that minimizes it (Young/Daly).

At a thousand GPUs something fails every few hours. A run then pays three times: the checkpoints
it writes, the restarts, and the work since the last checkpoint, trained again. With one node's
mean time between failures (``cluster.mtbf_hours``) the job's is ``M = mtbf / nodes`` (any node
stops it). A checkpoint every ``tau`` seconds of training, each taking ``delta`` to write and ``R`` to
restart from, makes the expected wall time per second of failure-free training

    (1 + delta / tau) * (1 + (R + (tau + delta) / 2) / M)

(each interval of ``tau`` is followed by a save; a failure lands on average halfway through an
interval and costs the restart and that half again: Daly, "A higher order estimate of the optimum
checkpoint interval for restart dumps", FGCS 2006, first order). Its minimum is near
``tau = sqrt(2 delta M) - delta`` (Young 1974, with Daly's correction), and ``M`` when saves take
as long as failures are apart.

The save time is the checkpoint's bytes (the 16-bit weights, the fp32 master copy and the optimizer's
moments: what every engine writes) spread over the nodes, at ``cluster.storage_gb_per_s`` each.
It is the same for every plan of one model on one cluster, so it scales every plan's time alike and
leaves the ranking as it was: what it adds is the expected time and the interval to set. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orch.plans.spec import ClusterSpec, OptimizerName, OptimSpec, Precision

_FP32 = 4


def checkpoint_bytes(param_count: int, precision: Precision, optim: OptimSpec) -> int:
    """Bytes of one checkpoint of the whole model: its weights in the training precision, an fp32
    master copy in mixed precision, and the optimizer's moments (Adam two, SGD with momentum one)."""
    weights = precision.element_bytes
    master = _FP32 if precision != Precision.fp32 else 0
    if optim.name in (OptimizerName.adam, OptimizerName.adamw):
        moments = 2 * _FP32
    else:
        moments = _FP32 if optim.momentum > 0 else 0
    return param_count * (weights + master + moments)


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """A cluster's failures, as one training job sees them."""

    job_mtbf_s: float
    """Mean seconds between failures of any of the job's nodes."""
    save_s: float
    """Seconds to write one checkpoint."""
    restart_s: float
    """Seconds from a failure to training again (rescheduling, start-up, loading)."""
    checkpoint_gb: float

    @property
    def interval_s(self) -> float:
        """Seconds of training between two checkpoints that minimize the expected wall time."""
        if self.save_s >= self.job_mtbf_s / 2:
            return self.job_mtbf_s
        return max(math.sqrt(2 * self.save_s * self.job_mtbf_s) - self.save_s, self.save_s)

    def factor(self, interval_s: float | None = None) -> float:
        """Expected wall time per second of failure-free training, checkpointing every ``interval_s``
        (the optimal interval by default)."""
        tau = self.interval_s if interval_s is None else interval_s
        return (1 + self.save_s / tau) * (1 + (self.restart_s + (tau + self.save_s) / 2) / self.job_mtbf_s)

    def checkpoint_every(self, step_s: float) -> int:
        """The interval in optimizer steps of ``step_s`` seconds (at least 1): train.checkpoint_every."""
        return max(1, round(self.interval_s / step_s))

    def describe(self) -> str:
        return (f"a failure every {self.job_mtbf_s / 3600:.3g} h on average (cluster.mtbf_hours over the nodes); "
                f"a checkpoint of {self.checkpoint_gb:.3g} GB written in {self.save_s:.3g} s "
                f"(cluster.storage_gb_per_s per node), a restart {self.restart_s:.3g} s (cluster.restart_s): "
                f"checkpoint every {self.interval_s:.3g} s of training (Young/Daly), "
                f"{100 * (self.factor() - 1):.1f}% more wall time than without failures")


def failure_model(cluster: ClusterSpec, param_count: int, precision: Precision, optim: OptimSpec
                  ) -> FailureModel | None:
    """The failures ``cluster`` declares (None without ``cluster.mtbf_hours``)."""
    if cluster.mtbf_hours is None:
        return None
    nbytes = checkpoint_bytes(param_count, precision, optim)
    return FailureModel(job_mtbf_s=cluster.mtbf_hours * 3600 / cluster.nodes,
                        save_s=nbytes / 1e9 / (cluster.storage_gb_per_s * cluster.nodes),
                        restart_s=cluster.restart_s, checkpoint_gb=nbytes / 1e9)
