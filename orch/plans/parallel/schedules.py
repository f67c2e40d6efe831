"""Pipeline schedules as arithmetic: which stages a rank runs, what a schedule demands of the
plan, the bubble it leaves and the micro-batches whose activations it holds at once.

Pure functions of the degrees (no torch): the planner, the tuner and the engine share them, so
the stages a worker builds are the stages the plan priced.

Terms, per micro-batch and per rank (its ``v`` stages together): ``F`` the forward, ``B`` the
backward to the inputs (activation gradients), ``W`` the backward to the weights. A backward is
``B + W``; schedules that do not split backward run them together.

Bubbles (idle time per step, in those units), from the papers that introduced each schedule:

* GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2019): ``(p - 1)(F + B + W)``; 1F1B
  only holds fewer micro-batches.
* Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): each of the ``v`` stages of a rank is
  ``1/v`` of its layers, so the fill and drain take ``1/v`` as long: ``(p - 1)(F + B + W) / v``.
* Zero bubble (Qi et al. 2024, ZB-H1 ordering, looped as torch's interleaved zero bubble):
  weight gradients are deferred into the drain: ``(p - 1)(F + B - W) / v``.
* ZB-V (the same paper, two stages per rank in a V): ``(p - 1)(F + B - 2W) / v``, none at all
  when a weight gradient takes as long as the input's, at the memory of 1F1B.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from orch.plans.errors import Violation
from orch.plans.spec import PipelineSchedule


def schedule_of(value: PipelineSchedule | str) -> PipelineSchedule:
    """The schedule ``value`` names; ValueError for anything else."""
    return value if isinstance(value, PipelineSchedule) else PipelineSchedule(str(value).strip().lower())


def stages_of_rank(pp_rank: int, pp: int, virtual: int, schedule: PipelineSchedule) -> list[int]:
    """The stage indices (of ``pp * virtual``) pipeline rank ``pp_rank`` runs, in order.

    Looped (torch's interleaved schedules, Megatron-LM's): rank ``r`` runs ``r, r + pp, ...``.
    V-shaped (ZB-V): rank ``r`` runs ``r`` and ``2 * pp - 1 - r``, so the first and last stages
    sit on rank 0 and a micro-batch turns around on rank ``pp - 1`` without a transfer."""
    if schedule is PipelineSchedule.zbv:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def rank_of_stage(stage: int, pp: int, virtual: int, schedule: PipelineSchedule) -> int:
    """The pipeline rank that runs ``stage``."""
    return next(r for r in range(pp) if stage in stages_of_rank(r, pp, virtual, schedule))


def torch_schedule_violations(schedule: PipelineSchedule | str, *, pp: int, micro_batches: int) -> list[Violation]:
    """What torch's schedule objects refuse at construction: ``Schedule1F1B`` fewer micro-batches
    than stages (DeepSpeed's 1F1B runs them, most stages idle)."""
    if pp > 1 and schedule_of(schedule) is PipelineSchedule.one_f_one_b and micro_batches < pp:
        return [Violation("plan.grad_accum_steps", micro_batches,
                          f"torch's 1f1b schedule needs at least as many micro-batches per step as stages (pp={pp}).",
                          f"set plan.grad_accum_steps={pp} or more")]
    return []


def schedule_violations(schedule: PipelineSchedule | str, *, pp: int, virtual: int, micro_batches: int,
                        layers: int | None = None) -> list[Violation]:
    """What ``plan.pp_schedule``, ``plan.pp_virtual_stages`` and the micro-batches of a step
    (``plan.grad_accum_steps``) must satisfy together; ``layers`` (the model's pipeline layers,
    when known) must give every stage one."""
    try:
        kind = schedule_of(schedule)
    except ValueError:
        return [Violation("plan.pp_schedule", schedule, "is not a pipeline schedule.",
                          "set plan.pp_schedule to " + ", ".join(s.value for s in PipelineSchedule))]
    found = []
    if pp <= 1:
        return found  # no pipeline: the schedule is not read
    if virtual < 1:
        found.append(Violation("plan.pp_virtual_stages", virtual, "must be at least 1.",
                               "set plan.pp_virtual_stages=1 or more"))
        return found
    if kind is PipelineSchedule.zbv and virtual != 2:
        found.append(Violation("plan.pp_virtual_stages", virtual,
                               "the zbv schedule runs exactly two stages per rank (a V).",
                               "set plan.pp_virtual_stages=2 with plan.pp_schedule=zbv"))
    elif kind.interleaved and virtual < 2:
        found.append(Violation("plan.pp_virtual_stages", virtual,
                               f"the {kind.value} schedule interleaves several stages per rank.",
                               f"set plan.pp_virtual_stages=2 or more with plan.pp_schedule={kind.value}, or "
                               "plan.pp_schedule=1f1b"))
    elif not kind.interleaved and virtual != 1:
        found.append(Violation("plan.pp_virtual_stages", virtual,
                               f"the {kind.value} schedule runs one stage per rank.",
                               "set plan.pp_virtual_stages=1, or plan.pp_schedule=interleaved_1f1b to run "
                               f"{virtual} stages per rank"))
    if found:
        return found
    if kind in (PipelineSchedule.interleaved_1f1b, PipelineSchedule.zero_bubble):
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            found.append(Violation("plan.grad_accum_steps", micro_batches,
                                   f"the {kind.value} schedule runs micro-batches in rounds of pp({pp}): "
                                   f"{micro_batches} is not a multiple of its {rounds} rounds.",
                                   f"set plan.grad_accum_steps to a multiple of {pp}"))
    if layers is not None and layers < pp * virtual:
        found.append(Violation("plan.pp_virtual_stages", virtual,
                               f"pp({pp}) * pp_virtual_stages({virtual}) = {pp * virtual} stages, but the model "
                               f"has {layers} pipeline layers.",
                               f"set plan.pp_virtual_stages={max(layers // pp, 1)} or less, or a smaller plan.pp"))
    return found


@dataclass(frozen=True)
class BackwardSplit:
    """A micro-batch's work on one rank, as shares of its forward plus backward."""

    forward: float
    """F: the forward (with full recomputation, the recomputed forward is part of B instead)."""
    inputs: float
    """B: the backward to the inputs."""
    weights: float
    """W: the backward to the weights."""

    @classmethod
    def of_matmuls(cls, recompute_share: float = 0.0) -> BackwardSplit:
        """A matmul-bound layer: each of the backward's two matmuls costs what the forward's does
        (F = B = W); ``recompute_share`` (of a forward) runs again before B."""
        total = 3.0 + recompute_share
        return cls(forward=1.0 / total, inputs=(1.0 + recompute_share) / total, weights=1.0 / total)


def bubble_micro_batches(schedule: PipelineSchedule, pp: int, virtual: int,
                         split: BackwardSplit | None = None) -> float:
    """Idle time a step loses to filling and draining the pipeline, in micro-batch times (one
    micro-batch's forward and backward on one rank): the module docstring's bubbles."""
    if pp <= 1:
        return 0.0
    split = split or BackwardSplit.of_matmuls()
    f, b, w = split.forward, split.inputs, split.weights
    per_fill = {
        PipelineSchedule.gpipe: f + b + w,
        PipelineSchedule.one_f_one_b: f + b + w,
        PipelineSchedule.interleaved_1f1b: (f + b + w) / virtual,
        PipelineSchedule.zero_bubble: max(0.0, f + b - w) / virtual,
        PipelineSchedule.zbv: max(0.0, f + b - 2 * w) / virtual,
    }[schedule]
    return (pp - 1) * per_fill


def micro_batches_in_flight(schedule: PipelineSchedule, pp: int, virtual: int, micro_batches: int,
                            pp_rank: int = 0) -> float:
    """Micro-batches whose activations (of all of a rank's stages) pipeline rank ``pp_rank`` holds
    at its peak, in units of one micro-batch through all its layers.

    GPipe holds every micro-batch of the step; 1F1B ``pp - r``; interleaved 1F1B adds the warm-up
    of the extra stages, ``pp + (pp - 1 - 2r) / v`` for rank ``r`` (Megatron-LM's
    ``p (1 + (p - 1) / (p v))`` on rank 0). The schedules that split backward are counted along
    their own order (:func:`zbv_actions`, :func:`zero_bubble_actions`): ZB-V holds what 1F1B's
    first rank does, ``pp``, given ``2 pp - 1`` micro-batches; the looped zero-bubble schedule's
    warm-up is one forward a later rank shorter where interleaved 1F1B's is two. Never more than
    the step's micro-batches."""
    if pp <= 1:
        return 1.0
    if schedule.splits_backward:
        return max(1.0, _walk_split_schedule(schedule, pp, virtual, micro_batches, pp_rank)[0])
    if schedule is PipelineSchedule.gpipe:
        held = float(micro_batches)
    elif schedule is PipelineSchedule.one_f_one_b:
        held = float(pp - pp_rank)
    else:
        held = pp + (pp - 1 - 2 * pp_rank) / virtual
    return max(1.0, min(held, float(micro_batches)))


@dataclass(frozen=True)
class SplitBackwardMoment:
    """A rank of a schedule that splits backward, as one input backward (``I``) of it runs: per
    local stage (chunk), the micro-batches whose activations it still holds (forward done, weight
    backward not yet: torch's ``stage_backward_input`` keeps the autograd graph for the weight
    pass) and those whose weight backward waits (input backward done), with the gradients it
    keeps for it."""

    held: tuple[int, ...]
    """Per chunk, micro-batches forward but not weight-backward, the one whose ``I`` runs included."""
    waiting_weights: tuple[int, ...]
    """Per chunk, micro-batches past their ``I`` and before their ``W``, the running one excluded."""


def zbv_actions(pp: int, micro_batches: int, pp_rank: int) -> list[tuple[str, int, int]]:
    """The order ZB-V (Qi et al. 2024, section 6; torch's ``ScheduleZBVZeroBubble``) runs one rank's
    work in: ``(kind, chunk, micro-batch)`` with kind ``F`` (forward), ``I`` (backward to the
    inputs) or ``W`` (backward to the weights), chunk 0 the rank's stage on the way down the V
    (stage ``pp_rank``) and chunk 1 the one on the way up (stage ``2 pp - 1 - pp_rank``).

    Warm-up fills the V: chunk 0 forwards until the micro-batch reaches the bottom, then both chunks
    forward in turn, then chunk 1 runs each micro-batch through F, I and W. The steady state runs
    one micro-batch forward and one backward (I then W at once) per chunk. The cool-down runs the
    remaining input backwards, deferring the weight backwards of the first ``pp_rank`` pairs into
    the drain, where they fill the bubble. The schedule is laid out for at least ``2 pp - 1``
    micro-batches; with fewer, the work of those that do not exist is left out."""
    n = max(2 * pp - 1, micro_batches)
    order: list[tuple[str, int, int]] = []
    nxt = {"F0": 0, "F1": 0, "I0": 0, "I1": 0, "W0": 0, "W1": 0}

    def run(kind: str, chunk: int) -> None:
        key = f"{kind}{chunk}"
        order.append((kind, chunk, nxt[key]))
        nxt[key] += 1

    for _ in range(2 * (pp - pp_rank) - 1):
        run("F", 0)
    for _ in range(pp_rank):
        run("F", 1)
        run("F", 0)
    for _ in range(pp - pp_rank):
        for kind in "FIW":
            run(kind, 1)
    while nxt["F1"] < nxt["F0"] or nxt["F0"] < n:
        if nxt["F0"] < n:
            run("F", 0)
        run("I", 0)
        run("W", 0)
        for kind in "FIW":
            run(kind, 1)
    for _ in range(pp_rank):
        run("I", 0)
        run("I", 1)
    for _ in range(pp - pp_rank):
        run("I", 0)
        run("W", 0)
    for chunk in (1, 0):
        while nxt[f"W{chunk}"] < nxt[f"I{chunk}"]:
            run("W", chunk)
    return [action for action in order if action[2] < micro_batches]


def zero_bubble_actions(pp: int, virtual: int, micro_batches: int, pp_rank: int) -> list[tuple[str, int, int]]:
    """The order the looped zero-bubble schedule (torch's ``ScheduleInterleavedZeroBubble``) runs one
    rank's work in, as :func:`zbv_actions` gives it; chunk ``c`` is the rank's stage ``c pp + r``.

    Interleaved 1F1B's order (micro-batches in rounds of ``m / max(1, m // pp)``, each chunk
    forwarding a round in turn; the warm-up one round per later chunk and ``pp - 1 - r`` forwards
    more) with each backward split: rank ``r`` runs each weight backward ``r`` input backwards
    after its own, and the last ``r`` in the drain."""
    rounds = max(1, micro_batches // pp)
    per_round = micro_batches // rounds
    total = virtual * micro_batches
    warmup = min((virtual - 1) * per_round + pp - 1 - pp_rank, total)
    order: list[tuple[str, int, int]] = []
    counts = {("F", c): 0 for c in range(virtual)} | {("I", c): 0 for c in range(virtual)}
    counts |= {("W", c): 0 for c in range(virtual)}
    backwards: list[int] = []

    def run(kind: str, chunk: int) -> None:
        order.append((kind, chunk, counts[kind, chunk]))
        counts[kind, chunk] += 1

    def weight_after(step: int) -> None:
        if step - warmup >= pp_rank:
            run("W", backwards[len(backwards) - 1 - pp_rank])

    for step in range(total + warmup):
        if step < total:
            run("F", (step // per_round) % virtual)
        if step >= warmup:
            chunk = virtual - 1 - ((step - warmup) // per_round) % virtual
            run("I", chunk)
            backwards.append(chunk)
            weight_after(step)
    for chunk in backwards[len(backwards) - min(pp_rank, len(backwards)):]:
        run("W", chunk)
    return order


def split_backward_moments(schedule: PipelineSchedule, pp: int, virtual: int, micro_batches: int,
                           pp_rank: int) -> tuple[SplitBackwardMoment, ...]:
    """The moments of a rank of a schedule that splits backward (:func:`zbv_actions`,
    :func:`zero_bubble_actions`) that no other moment holds as much as, in every chunk: what its
    memory can peak at during an input backward."""
    return _walk_split_schedule(schedule, pp, virtual, micro_batches, pp_rank)[1]


@functools.lru_cache(maxsize=4096)
def _walk_split_schedule(schedule: PipelineSchedule, pp: int, virtual: int, micro_batches: int,
                         pp_rank: int) -> tuple[float, tuple[SplitBackwardMoment, ...]]:
    """One rank's order walked through: the most micro-batches it holds after a forward (through
    all its chunks, an average over them) and :func:`split_backward_moments`. Cached: the tuner
    asks for the same few degrees for every plan of the schedule it prices."""
    actions = (zbv_actions(pp, micro_batches, pp_rank) if schedule is PipelineSchedule.zbv
               else zero_bubble_actions(pp, virtual, micro_batches, pp_rank))
    chunks = 2 if schedule is PipelineSchedule.zbv else virtual
    held: list[set[int]] = [set() for _ in range(chunks)]
    waiting: list[set[int]] = [set() for _ in range(chunks)]
    most, moments = 0, set()
    for kind, chunk, micro_batch in actions:
        if kind == "F":
            held[chunk].add(micro_batch)
            most = max(most, sum(len(h) for h in held))
        elif kind == "I":
            moments.add(SplitBackwardMoment(held=tuple(len(h) for h in held),
                                            waiting_weights=tuple(len(w) for w in waiting)))
            waiting[chunk].add(micro_batch)
        else:
            held[chunk].discard(micro_batch)
            waiting[chunk].discard(micro_batch)

    def covers(a: SplitBackwardMoment, b: SplitBackwardMoment) -> bool:
        return a != b and all(x >= y for x, y in zip(a.held + a.waiting_weights, b.held + b.waiting_weights,
                                                             strict=True))

    fullest = tuple(sorted((m for m in moments if not any(covers(o, m) for o in moments)),
                           key=lambda m: (m.held, m.waiting_weights)))
    return most / chunks, fullest
