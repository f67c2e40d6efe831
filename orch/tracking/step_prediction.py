"""A run's predicted step, tracked beside what its steps measure.

`orch train` logs the plan's step as `orch check` predicts it (at the cluster profile's measured
speeds, else the declared ones) as run params, its total, each part and where the speeds came from;
`orch report` sets it beside the measured step time.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from orch.plans.step_time.cost_model import StepTime

PREDICTED_STEP_PARAM = "step_time.predicted"
"""The prefix of the predicted step's params: ``.total_s`` and ``.<part>_s`` for each part of
:meth:`orch.plans.step_time.cost_model.StepTime.as_dict` (compute, memory, bubble, tp, dp, ...)."""


def predicted_step_params(step: StepTime, speeds: str) -> dict[str, str]:
    """The plan's predicted step as run params, its total and each part in seconds, and ``speeds``:
    where the speeds it was priced at came from (``measured`` by `orch calibrate`, or ``declared``)."""
    doc = step.as_dict()
    params = {f"{PREDICTED_STEP_PARAM}.total_s": f"{doc['step_time_s']:.6g}", f"{PREDICTED_STEP_PARAM}.speeds": speeds}
    params.update({f"{PREDICTED_STEP_PARAM}.{part}_s": f"{seconds:.6g}" for part, seconds in doc["parts_s"].items()})
    return params


def step_time_lines(client: MlflowClient, run_id: str, params: dict[str, str]) -> list[str]:
    """The plan's predicted step beside the median of the run's later half of logged steps (the
    first steps carry warm-up, the memory probe and the allocator's growth)."""
    predicted = params.get(f"{PREDICTED_STEP_PARAM}.total_s")
    history = sorted(client.get_metric_history(run_id, "step_time_s"), key=lambda point: point.step)
    if predicted is None or not history:
        return []
    later = history[len(history) // 2:]
    measured = statistics.median(point.value for point in later)
    prefix = f"{PREDICTED_STEP_PARAM}."
    parts = {key[len(prefix):-len("_s")]: float(value) for key, value in params.items()
             if key.startswith(prefix) and key.endswith("_s") and key != f"{prefix}total_s" and float(value) > 0}
    speeds = params.get(f"{prefix}speeds", "declared")
    largest = sorted(parts.items(), key=lambda item: -item[1])
    return [f"step time  measured {measured:.4g} s (median of steps {later[0].step}-{later[-1].step}), predicted "
            f"{float(predicted):.4g} s at the {speeds} speeds: measured / predicted {measured / float(predicted):.2f}",
            "           predicted parts: " + ", ".join(f"{name} {seconds:.3g} s" for name, seconds in largest)
            + " (each part's measured time is not recorded yet)"]
