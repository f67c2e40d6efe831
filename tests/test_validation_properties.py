"""Property-based: whatever values a user types, validation answers with our own error type,
and every rejection names a field and a fix."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from plans.errors import PlanError
from plans.resolve import resolve_plan
from plans.spec import Accelerator, ClusterSpec, Offload, PlanSpec, Precision, TrainSpec

ints = st.integers(min_value=-4, max_value=64)

plans = st.builds(
    PlanSpec, dp=st.none() | ints, tp=ints, pp=ints, zero_stage=ints,
    offload_optimizer=st.sampled_from(Offload), offload_param=st.sampled_from(Offload),
    nvme_path=st.none() | st.just("/nvme"), activation_checkpointing=st.booleans(),
    micro_batch_size=ints, grad_accum_steps=ints, precision=st.sampled_from(Precision))
clusters = st.builds(ClusterSpec, nodes=ints, devices_per_node=ints, accelerator=st.sampled_from(Accelerator))
trains = st.builds(TrainSpec, steps=ints, log_every=ints, global_batch_size=st.none() | ints)


@settings(max_examples=500, deadline=None)
@given(plans, clusters, trains)
def test_validation_raises_only_plan_errors_naming_fields(plan, cluster, train):
    try:
        resolved = resolve_plan(plan, cluster, train)
    except PlanError as error:
        assert error.violations
        for violation in error.violations:
            assert violation.field.split(".")[0] in {"plan", "cluster", "train", "model"}
            assert violation.fix and violation.message
    else:
        assert resolved.dp * resolved.tp * resolved.pp == resolved.world_size == cluster.world_size
        assert resolved.zero_stage in (0, 1, 2, 3)
