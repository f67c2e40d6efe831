"""The P10-P90 ranges around predicted step times: the quantile arithmetic (pure), which set covers
which prediction, and the shipped error sets against what the cost model predicts today."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from orch.plans.step_time.ranges import (
    ERRORS_FILE,
    REGENERATE,
    ErrorSet,
    StepRange,
    error_sets,
    predicted_range,
    range_in,
    ratio_quantiles,
)


def test_p10_and_p90_interpolate_between_the_sorted_ratios_with_the_extremes_as_p0_and_p100():
    # 11 cases 1..11: P10 sits at position 0.1 x 10 = 1 of the sorted list, P90 at 9.
    assert ratio_quantiles([float(r) for r in range(11, 0, -1)]) == pytest.approx((2.0, 10.0))
    # 5 cases: P10 at position 0.4 (0.9 + 0.4 x 0.1), P90 at 3.6 (1.2 + 0.6 x 0.8).
    assert ratio_quantiles([2.0, 1.1, 0.9, 1.2, 1.0]) == pytest.approx((0.94, 1.68))
    # Never outside what was measured, however few the cases.
    assert ratio_quantiles([0.8, 1.3]) == pytest.approx((0.85, 1.25))


def _set(speeds: str, accelerator: str, ratios: tuple[float, ...]) -> ErrorSet:
    return ErrorSet(speeds=speeds, accelerator=accelerator, ratios=ratios, cases_are="reference runs",
                    script="bench/x.py")


def test_a_prediction_gets_the_range_of_its_own_speeds_and_accelerator_scaled_by_it():
    sets = {"declared": _set("declared", "gpu", (2.0, 1.1, 0.9, 1.2, 1.0)), "measured": _set("measured", "cpu", (3.0,))}
    ratios = range_in(sets, "declared", "gpu")
    assert (ratios.p10, ratios.p90, ratios.cases) == (pytest.approx(0.94), pytest.approx(1.68), 5)
    assert ratios.source == "P10-P90 of 5 reference runs' measured/predicted step time, bench/x.py"
    # A time to train or a cost is the step time times a constant: the same ratios bound it.
    hours = ratios.scaled(10.0)
    assert (hours.p10, hours.p90) == (pytest.approx(9.4), pytest.approx(16.8))
    assert hours.as_json() == {"p10": hours.p10, "p90": hours.p90, "cases": 5, "source": ratios.source}


@pytest.mark.parametrize(("sets", "speeds", "accelerator", "why"), [
    (None, "declared", "gpu", "prediction_errors.json is not installed (it is made by " + REGENERATE),
    ({}, "measured", "cpu", "no reference cases were predicted at measured speeds"),
    ({"declared": _set("declared", "gpu", (1.0, 1.1))}, "declared", "cpu",
     "the cost model's error at declared speeds is known for 2 reference runs on GPUs (bench/x.py), none on CPUs"),
    ({"measured": _set("measured", "cpu", (1.5,))}, "measured", "cpu",
     "1 reference runs at measured speeds: too few for a P10-P90"),
])
def test_without_cases_of_its_kind_a_prediction_gets_no_range_and_the_reason(sets, speeds, accelerator, why):
    none = range_in(sets, speeds, accelerator)
    assert not none.known and none.source.startswith("no range: ") and why in none.source
    assert none.scaled(3.0) == none and none.as_json()["p10"] is None


def test_the_shipped_sets_give_a_range_for_each_kind_of_speeds_they_measured():
    declared = predicted_range(2.0, speeds="declared", accelerator="gpu")
    measured = predicted_range(2.0, speeds="measured", accelerator="cpu")
    assert isinstance(declared, StepRange) and declared.known and measured.known
    assert declared.p10 <= declared.p90 and measured.p10 <= measured.p90
    assert "bench/megatron_sanity.py" in declared.source and "bench/tuner_accuracy.py" in measured.source
    assert not predicted_range(2.0, speeds="declared", accelerator="cpu").known


def _assert_shipped(speeds: str, today: dict) -> None:
    text = resources.files("orch.plans.step_time").joinpath(ERRORS_FILE).read_text()
    shipped = json.loads(text)["sets"][speeds]
    stale = f"the cost model's predictions of the {speeds} set moved; regenerate the ranges' data: {REGENERATE}"
    assert {k: v for k, v in shipped.items() if k != "cases"} == {k: v for k, v in today.items() if k != "cases"}, stale
    assert [c["case"] for c in shipped["cases"]] == [c["case"] for c in today["cases"]], stale
    for old, new in zip(shipped["cases"], today["cases"], strict=True):
        for key in ("predicted_s", "reference_s", "ratio"):
            assert old[key] == pytest.approx(new[key], rel=1e-6), f"{old['case']} {key}: {stale}"
    assert error_sets()[speeds].ratios == tuple(c["ratio"] for c in shipped["cases"])


def test_the_shipped_declared_set_is_what_the_published_runs_predict_today():
    """Eleven published runs predicted as bench/megatron_sanity.py predicts them (about 30 s), each
    Table 1 row within 15% of its published step time (GPT-NeoX-20B is the set's known outlier)."""
    from bench.prediction_errors import declared_set

    cases = declared_set()
    _assert_shipped("declared", cases)
    table_1 = [case for case in cases["cases"] if "NeoX" not in case["case"]]
    assert len(table_1) == 10 and all(abs(case["ratio"] - 1) <= 0.15 for case in table_1), table_1


def test_the_shipped_measured_set_is_what_the_stored_cpu_grids_reprice_to_today():
    """The CPU grids' 162 trials re-priced at their stored speeds, no training (a few seconds)."""
    from bench.prediction_errors import measured_set

    _assert_shipped("measured", measured_set())
