"""How far off a predicted step time is likely to be: the P10-P90 of the cost model's own error on
reference cases, as a range around the prediction.

A prediction alone reads as more certain than it is. The errors are data, not constants: ``python -m
bench.prediction_errors --write`` computes reference / predicted step time for each reference case
with the current cost model and writes them to ``prediction_errors.json`` beside this module (a
test fails when a cost-model change moves them and the file was not regenerated). Each set covers
one kind of speeds (``Speeds.source``) on one accelerator: declared speeds were checked against
published A100 runs, measured (calibrated) ones against a grid of CPU trials. A prediction of
another kind gets no range, and says why, rather than borrow an error nobody measured for it: the
declared CPU speeds, for one, are an order of magnitude.

Ranges scale linearly: a time to train or a cost is the step time times a constant, so the same
ratios bound them (:meth:`StepRange.scaled`).

Pure and without torch: `orch check` and `orch tune` read it before any model is built.
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

ERRORS_FILE = "prediction_errors.json"
REGENERATE = "python -m bench.prediction_errors --write"


@dataclass(frozen=True, kw_only=True)
class ErrorSet:
    """One set of reference cases: the cost model's ratios on them and where they come from."""

    speeds: str
    """The speeds its cases were predicted at: 'declared' or 'measured' (``Speeds.source``)."""
    accelerator: str
    """The devices its cases ran on: 'gpu' or 'cpu'."""
    ratios: tuple[float, ...]
    """Reference / predicted step time, one per case."""
    cases_are: str
    """What its cases are, as a reader would name them: 'published runs'."""
    script: str
    """The benchmark that holds the cases and computes the ratios."""

    @property
    def note(self) -> str:
        return f"P10-P90 of {len(self.ratios)} {self.cases_are}' measured/predicted step time, {self.script}"


@dataclass(frozen=True, kw_only=True)
class StepRange:
    """Where the measurement of a predicted value would fall, P10 to P90, or why that is not known."""

    p10: float | None
    p90: float | None
    cases: int
    """The reference cases the quantiles were taken over (0 without a range)."""
    source: str
    """What the range comes from (the set and its benchmark), or why there is none ('no range: ...')."""

    @property
    def known(self) -> bool:
        return self.p10 is not None

    def scaled(self, factor: float) -> StepRange:
        """The range of a value ``factor`` times this one's (a time to train, a cost, a prediction
        when this is the ratios' range)."""
        if not self.known:
            return self
        return StepRange(p10=self.p10 * factor, p90=self.p90 * factor, cases=self.cases, source=self.source)

    def as_json(self) -> dict:
        return {"p10": self.p10, "p90": self.p90, "cases": self.cases, "source": self.source}


def ratio_quantiles(ratios: Sequence[float]) -> tuple[float, float]:
    """P10 and P90 of ``ratios`` by ``statistics.quantiles(n=10, method="inclusive")``: linear
    interpolation between the sorted ratios, with the smallest as P0 and the largest as P100
    (numpy's default), so that a set of few cases never gives a range wider than what was measured."""
    deciles = statistics.quantiles(ratios, n=10, method="inclusive")
    return deciles[0], deciles[-1]


@functools.cache
def error_sets() -> dict[str, ErrorSet] | None:
    """The shipped sets by the speeds they cover, read once; None when the file is not installed."""
    try:
        text = resources.files("orch.plans.step_time").joinpath(ERRORS_FILE).read_text()
    except FileNotFoundError:
        return None
    return {speeds: ErrorSet(speeds=speeds, accelerator=doc["accelerator"], cases_are=doc["cases_are"],
                             script=doc["script"], ratios=tuple(case["ratio"] for case in doc["cases"]))
            for speeds, doc in json.loads(text)["sets"].items()}


def _none(reason: str) -> StepRange:
    return StepRange(p10=None, p90=None, cases=0, source=f"no range: {reason}")


def range_in(sets: dict[str, ErrorSet] | None, speeds: str, accelerator: str) -> StepRange:
    """The range of reference / predicted step time that ``sets`` give predictions at ``speeds``
    ('declared' or 'measured') on ``accelerator`` devices, or why they give none."""
    if sets is None:
        return _none(f"orch/plans/step_time/{ERRORS_FILE} is not installed (it is made by {REGENERATE})")
    found = sets.get(speeds)
    if found is None:
        return _none(f"no reference cases were predicted at {speeds} speeds")
    if found.accelerator != accelerator:
        return _none(f"the cost model's error at {speeds} speeds is known for {len(found.ratios)} "
                     f"{found.cases_are} on {found.accelerator.upper()}s ({found.script}), none on "
                     f"{accelerator.upper()}s")
    if len(found.ratios) < 2:
        return _none(f"{len(found.ratios)} {found.cases_are} at {speeds} speeds: too few for a P10-P90")
    p10, p90 = ratio_quantiles(found.ratios)
    return StepRange(p10=p10, p90=p90, cases=len(found.ratios), source=found.note)


@functools.cache
def ratio_range(speeds: str, accelerator: str) -> StepRange:
    """:func:`range_in` the shipped sets: a prediction's range is this :meth:`~StepRange.scaled` by it."""
    return range_in(error_sets(), speeds, accelerator)


def predicted_range(predicted: float, *, speeds: str, accelerator: str) -> StepRange:
    """The P10-P90 range of a value predicted at ``speeds`` on ``accelerator`` devices."""
    return ratio_range(speeds, accelerator).scaled(predicted)


def held_out_range(ratios: Sequence[float], what: str) -> StepRange:
    """The P10-P90 of ``ratios``, measured / predicted step time of a cluster profile's recorded runs,
    each predicted with the corrections of the others only (``what`` says so), or why there is none."""
    if len(ratios) < 2:
        return _none(f"{len(ratios)} {what}: too few for a P10-P90")
    p10, p90 = ratio_quantiles(ratios)
    return StepRange(p10=p10, p90=p90, cases=len(ratios), source=f"P10-P90 of {len(ratios)} {what}")


def corrected_range() -> StepRange:
    """No range for a prediction a cluster profile corrected by finished runs: the shipped sets
    measured the cost model's error without corrections, which would misstate the corrected one's."""
    return _none("the cluster profile's corrections from finished runs change the error the reference cases "
                 "measured; `orch report` of the next run shows the corrected prediction's")
