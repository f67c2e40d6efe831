"""The cost model's error on its reference cases, per kind of speeds: the data behind the P10-P90
ranges `orch check` and `orch tune` print (orch/plans/step_time/ranges.py).

For each case, reference / predicted step time with the *current* cost model, without training:

- ``declared``: the published runs of :mod:`bench.megatron_sanity` (Megatron-LM SC'21 Table 1 and
  GPT-NeoX-20B, ``cluster=a100_8x`` as declared, :func:`bench.megatron_sanity.predict`): the
  published step time (each run's FLOPs as its own code counted them over its published TFLOP/s)
  over the predicted one.
- ``measured``: the calibrated CPU grids of :mod:`bench.tuner_accuracy`, whose trials are stored with
  the speeds calibration measured for them (``bench/results/tuner_accuracy.json``), re-priced at
  those speeds (:func:`bench.tuner_accuracy.repriced`): the measured step time over the predicted one.

With ``--write`` the sets go to ``orch/plans/step_time/prediction_errors.json``, which ships in the
package; without it, they are printed and compared with that file. A test fails when the shipped
sets no longer match the cost model, so that a change to it regenerates its ranges too.

    python -m bench.prediction_errors [--write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.harness import REPO
from bench.megatron_sanity import RUNS, predict
from bench.tuner_accuracy import repriced
from orch.plans.step_time.ranges import ERRORS_FILE, REGENERATE, ratio_quantiles
from orch.tune.result import describe

SHIPPED = REPO / "orch" / "plans" / "step_time" / ERRORS_FILE
GRIDS = REPO / "bench" / "results" / "tuner_accuracy.json"
GRID_WORKERS = (2, 4)


def case(name: str, predicted_s: float, reference_s: float) -> dict:
    return {"case": name, "predicted_s": predicted_s, "reference_s": reference_s, "ratio": reference_s / predicted_s}


def declared_set() -> dict:
    """The published runs, predicted at ``cluster=a100_8x``'s declared speeds."""
    cases = []
    for run in RUNS:
        row = predict(run)
        cases.append(case(run.name, row["step_s"], row["measured_step_s"]))
    return {"accelerator": "gpu", "cases_are": "published runs", "script": "bench/megatron_sanity.py",
            "results": "bench/results/megatron_sanity.md",
            "reference": "published step time: the run's FLOPs as its own code counted them over its published "
                         "TFLOP/s (Megatron-LM SC'21 Table 1, GPT-NeoX-20B)",
            "predicted": "cluster=a100_8x as declared, the published layout, batch and micro-batch "
                         "(bench.megatron_sanity.predict)",
            "cases": cases}


def measured_set(grids: Path = GRIDS) -> dict:
    """The stored CPU grids' trials, predicted at the speeds calibration measured for them."""
    cases = []
    for workers in GRID_WORKERS:
        for plan, trial, predicted_s in repriced(grids, workers):
            cases.append(case(f"{workers} workers: {describe(plan)}", predicted_s, trial["step_time_s"]))
    return {"accelerator": "cpu", "cases_are": "calibrated CPU trials", "script": "bench/tuner_accuracy.py",
            "results": str(grids.relative_to(REPO)),
            "reference": "the trial's measured step time (median of its timed steps)",
            "predicted": "re-priced with the speeds stored beside the trials (bench.tuner_accuracy.repriced)",
            "cases": cases}


def document(sets: dict[str, dict]) -> dict:
    return {"ratio": "reference / predicted step time", "generated_by": REGENERATE, "sets": sets}


def summary(speeds: str, found: dict, seconds: float) -> str:
    ratios = [c["ratio"] for c in found["cases"]]
    p10, p90 = ratio_quantiles(ratios)
    return (f"{speeds}: {len(ratios)} {found['cases_are']} ({found['script']}), reference / predicted "
            f"P10 {p10:.3f}, P50 {statistics.median(ratios):.3f}, P90 {p90:.3f}, "
            f"min {min(ratios):.3f}, max {max(ratios):.3f}; computed in {seconds:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write the sets to {SHIPPED.relative_to(REPO)}")
    args = parser.parse_args()
    sets = {}
    for speeds, make in (("declared", declared_set), ("measured", measured_set)):
        started = time.perf_counter()
        sets[speeds] = make()
        print(summary(speeds, sets[speeds], time.perf_counter() - started), flush=True)
    text = json.dumps(document(sets), indent=1) + "\n"
    if args.write:
        SHIPPED.write_text(text)
        print(f"written to {SHIPPED.relative_to(REPO)}")
    elif SHIPPED.exists() and SHIPPED.read_text() == text:
        print(f"{SHIPPED.relative_to(REPO)} holds these sets")
    else:
        print(f"{SHIPPED.relative_to(REPO)} differs from these sets: {REGENERATE}")


if __name__ == "__main__":
    main()
