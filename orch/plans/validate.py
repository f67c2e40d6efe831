"""Range checks of every declared number: what each field of the schemas may hold.

Types are Hydra's business (``plan.dp=abc`` fails at composition); ranges are ours. Each rule
names its dotted field, so the same table covers the sections of :mod:`orch.plans.spec` and the
orchestrator's own ``tracking`` and ``tune`` sections without importing them. The checks are pure:
the orchestrator collects their violations with the plan's (:func:`orch.plans.resolve.resolve_plan`)
and the file-system checks, and raises them together before anything starts.

Fields a rule does not list are checked elsewhere, with the arithmetic that relates them:
``plan.*`` degrees and batch sizes, ``cluster.nodes``/``devices_per_node``, ``train.steps``,
``train.log_every`` and ``train.global_batch_size`` by :func:`orch.plans.resolve.resolve_plan`;
the model's arguments by the model's own constructor (see :func:`orch.plans.model.model_facts.inspect_model`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from orch.plans.engines import engine_names
from orch.plans.errors import Violation

# Ray refuses an object store smaller than this (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES).
RAY_MIN_OBJECT_STORE_GIB = 75 / 1024
# Timeouts become datetime.timedelta and DeepSpeed's process-group timeout in minutes; a month
# is far beyond any sensible wait and far inside what both can represent.
MAX_TIMEOUT_S = 30 * 24 * 3600.0
# Seeds go to torch.manual_seed and torch.Generator.manual_seed (unsigned 64-bit; the layer
# seeds of orch/workloads/gpt.py stay below 2**63).
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Bound:
    """The interval one numeric field (or every element of a list field) must lie in."""

    field: str
    """Dotted key, e.g. ``train.hang_timeout_s``."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    """The value must be strictly above ``low``."""
    high_open: bool = False
    """The value must be strictly below ``high``."""
    meaning: str = ""
    """What the edge values mean to the user (e.g. ``0 disables``), appended to the message."""

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        def edge(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{edge(self.low)}, {edge(self.high)}{right}"
        if self.low is not None:
            return f"{'above' if self.low_open else 'at least'} {edge(self.low)}"
        return f"{'below' if self.high_open else 'at most'} {edge(self.high)}"


BOUNDS: tuple[Bound, ...] = (
    Bound("cluster.device_memory_gib", 0, low_open=True),
    Bound("cluster.host_memory_gib", 0, low_open=True),
    Bound("cluster.cpus_per_worker", 0, low_open=True, meaning="Ray CPUs each worker reserves"),
    Bound("cluster.object_store_memory_gib", RAY_MIN_OBJECT_STORE_GIB, meaning="Ray's minimum is 75 MiB"),
    Bound("cluster.wait_s", 0, MAX_TIMEOUT_S, low_open=True),
    Bound("cluster.connect_timeout_s", 0, MAX_TIMEOUT_S, low_open=True),
    Bound("cluster.device_tflops", 0, low_open=True),
    Bound("cluster.intra_node_gbps", 0, low_open=True),
    Bound("cluster.inter_node_gbps", 0, low_open=True),
    Bound("cluster.host_link_gbps", 0, low_open=True),
    Bound("cluster.device_memory_gb_per_s", 0, low_open=True),
    Bound("cluster.host_memory_gb_per_s", 0, low_open=True),
    Bound("cluster.device_sm_count", 1, meaning="streaming multiprocessors of one GPU"),
    Bound("cluster.device_hour_usd", 0, meaning="the price of one device for one hour"),
    Bound("cluster.mtbf_hours", 0, low_open=True, meaning="mean hours between failures of one node"),
    Bound("cluster.storage_gb_per_s", 0, low_open=True, meaning="GB/s a node writes a checkpoint at"),
    Bound("cluster.restart_s", 0, meaning="seconds a restart takes before training resumes"),
    Bound("train.straggler_threshold", 0, meaning="a share of the median step; 0 names no straggler"),
    Bound("train.straggler_reports", 1),
    Bound("train.tokens", 1, meaning="the token budget `orch tune` prices; null: steps x global batch x sequence"),
    Bound("optim.lr", 0, low_open=True),
    Bound("optim.weight_decay", 0),
    Bound("optim.betas", 0, 1, high_open=True, meaning="each of the two Adam betas"),
    Bound("optim.momentum", 0, 1, high_open=True),
    Bound("optim.warmup_steps", 0),
    Bound("optim.min_lr_ratio", 0, 1, meaning="the final learning rate as a fraction of optim.lr"),
    Bound("optim.grad_clip", 0, meaning="0 disables clipping"),
    Bound("train.eval_every", 0, meaning="0 evaluates only at the end"),
    Bound("train.eval_batches", 1),
    Bound("train.seed", 0, MAX_SEED),
    Bound("train.memory_probe_step", 0, meaning="0 disables the probe"),
    Bound("train.checkpoint_every", 0, meaning="0 never checkpoints"),
    Bound("train.keep_checkpoints", 1),
    Bound("train.max_failures", 0),
    Bound("train.hang_timeout_s", 0, MAX_TIMEOUT_S, meaning="seconds; 0 disables hang detection"),
    Bound("tracking.system_metrics_interval_s", 0, MAX_TIMEOUT_S, meaning="seconds; 0 turns system metrics off"),
    Bound("train.setup_timeout_s", 0, MAX_TIMEOUT_S, meaning="seconds; 0 disables the setup deadline"),
    Bound("train.elastic.min_devices", 1, meaning="the fewest surviving devices a run re-plans for"),
    Bound("train.elastic.wait_s", 0, MAX_TIMEOUT_S, meaning="seconds a replacement may take; 0 re-plans at once"),
    Bound("train.elastic.batch_tolerance", 0, 1, high_open=True,
          meaning="the share the global batch may move by; 0 keeps it exactly"),
    Bound("train.elastic.replan_timeout_s", 0, MAX_TIMEOUT_S, low_open=True),
    Bound("data.seq_len", 1),
    Bound("data.val_fraction", 0, 1, low_open=True, high_open=True,
          meaning="the tail of the corpus held out for evaluation; both parts must be non-empty"),
    Bound("data.shuffle_buffer", 0, meaning="0 keeps the stream's order"),
    Bound("data.cpus_per_task", 0, low_open=True, meaning="CPUs each Ray Data task reserves"),
    Bound("data.image_size", 1),
    Bound("tune.trials", 0, meaning="0 predicts only"),
    Bound("tune.trial_steps", 1),
    Bound("tune.trial_timeout_s", 0, MAX_TIMEOUT_S, low_open=True),
    Bound("tune.top_k", 1),
    Bound("tune.tp", 1, meaning="each degree"),
    Bound("tune.pp", 1, meaning="each degree"),
    Bound("tune.zero_stages", 0, 3, meaning="each stage"),
    Bound("tune.micro_batch_sizes", 1, meaning="each size"),
)

# Optimizer fields that hold a fixed number of values.
LIST_LENGTHS = {"optim.betas": 2}
# Tracking fallbacks `orch train` knows (tracking.fallback).
TRACKING_FALLBACKS = (None, "local")


def field_violations(sections: Mapping[str, object], bounds: tuple[Bound, ...] = BOUNDS) -> list[Violation]:
    """Every field of ``sections`` (``{"train": TrainSpec(...), ...}``) outside its bound.

    A section not given is skipped, and so is a field whose value is None (null means "the
    default behaviour" for every optional field listed here)."""
    found: list[Violation] = []
    for bound in bounds:
        section, name = bound.field.split(".", 1)
        if section not in sections:
            continue
        # A nested field (``train.elastic.wait_s``) is read through its section's sub-sections.
        *parents, name = name.split(".")
        spec = sections[section]
        for parent in parents:
            spec = getattr(spec, parent, None)
        value = getattr(spec, name, None)  # a data source without this field has nothing to check
        if value is None:
            continue
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not all(bound.admits(v) for v in values):
            found.append(_out_of_bounds(bound, value, _default(spec, name)))
    found += _shape_violations(sections)
    return found


def _out_of_bounds(bound: Bound, value: object, default: object) -> Violation:
    meaning = f" ({bound.meaning})" if bound.meaning else ""
    fix = f"set {bound.field} {bound.describe()}"
    if default is not None:
        fix += f", e.g. its default {bound.field}={_override(default)}"
    return Violation(bound.field, value, f"must be {bound.describe()}{meaning}.", fix)


def _shape_violations(sections: Mapping[str, object]) -> list[Violation]:
    """The checks that are not intervals: list lengths and named choices."""
    found = []
    for key, length in LIST_LENGTHS.items():
        section, name = key.split(".", 1)
        if section in sections and len(getattr(sections[section], name)) != length:
            value = getattr(sections[section], name)
            found.append(Violation(key, value, f"must hold {length} values, not {len(value)}.",
                                   f"set {key}={_override(_default(sections[section], name))}"))
    tune = sections.get("tune")
    engines = getattr(tune, "engines", None)
    known = engine_names()
    if engines is not None and (not engines or any(e not in known for e in engines)):
        found.append(Violation("tune.engines", list(engines), f"the tuner searches the engines {', '.join(known)}.",
                               f"set tune.engines=[{','.join(known)}] or a subset of it"))
    tracking = sections.get("tracking")
    if tracking is not None:
        if tracking.fallback not in TRACKING_FALLBACKS:
            found.append(Violation("tracking.fallback", tracking.fallback, "is not a fallback orch knows.",
                                   "set tracking.fallback=local, or null to fail when the server is unreachable"))
        if not tracking.experiment.strip():
            found.append(Violation("tracking.experiment", tracking.experiment, "an MLflow experiment needs a name.",
                                   f"set tracking.experiment={_default(tracking, 'experiment')}"))
    return found


def _default(spec: object, name: str) -> object:
    """The schema's default of ``spec.name`` (None when it has none or is not a dataclass)."""
    if not dataclasses.is_dataclass(spec):
        return None
    for f in dataclasses.fields(spec):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return None


def _override(value: object) -> str:
    """``value`` as a Hydra override writes it."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override(v) for v in value) + "]"
    if hasattr(value, "value"):
        return str(value.value)
    return f"{value:g}" if isinstance(value, float) else str(value)
