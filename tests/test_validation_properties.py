"""Property-based: whatever values a user types, validation answers with our own error type,
and every rejection names a field and a fix."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orch.plans.errors import OrchError, PlanError
from orch.plans.resolve import resolve_plan
from orch.plans.spec import Accelerator, ClusterSpec, Offload, PlanSpec, Precision, TrainSpec

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


# --- The whole pre-launch path, over every field of the config -------------------------------

INT_FIELDS = ["plan.dp", "plan.tp", "plan.pp", "plan.zero_stage", "plan.micro_batch_size", "plan.grad_accum_steps",
              "cluster.nodes", "cluster.devices_per_node", "optim.warmup_steps", "train.steps", "train.log_every",
              "train.eval_every", "train.eval_batches", "train.seed", "train.global_batch_size",
              "train.memory_probe_step", "train.checkpoint_every", "train.keep_checkpoints", "train.max_failures",
              "data.seq_len", "tune.trials", "tune.trial_steps", "tune.top_k"]
FLOAT_FIELDS = ["cluster.device_memory_gib", "cluster.host_memory_gib", "cluster.cpus_per_worker",
                "cluster.object_store_memory_gib", "cluster.wait_s", "cluster.device_tflops", "cluster.intra_node_gbps",
                "cluster.inter_node_gbps", "cluster.host_link_gbps", "cluster.device_memory_gb_per_s",
                "cluster.host_memory_gb_per_s", "optim.lr", "optim.weight_decay", "optim.momentum",
                "optim.min_lr_ratio", "optim.grad_clip", "train.hang_timeout_s", "train.setup_timeout_s",
                "data.val_fraction", "tune.trial_timeout_s"]
# The model's arguments stay small: how deep models are checked quickly is tested elsewhere.
MODEL_FIELDS = ["model.n_layer", "model.d_model", "model.n_head", "model.seq_len", "model.vocab_size"]
LIST_FIELDS = ["optim.betas", "tune.tp", "tune.pp", "tune.zero_stages", "tune.micro_batch_sizes"]
PATH_CASES = ["missing", "directory", "empty", "tiny", "not_gzip.gz", "file"]

int_values = st.sampled_from([-(2**40), -3, -1, 0, 1, 2, 3, 8, 10**6, 2**40])
float_values = st.sampled_from(["-1.0", "0.0", "1e-09", "0.5", "1.0", "2.0", "1e+30", "nan", "inf", "-inf"])
model_values = st.sampled_from([-1, 0, 1, 2, 3, 8, 64])
float_lists = st.sampled_from(["[]", "[0.9]", "[-1.0,2.0]", "[0.9,0.95]", "[1.5,0.5]", "[nan,0.9]"])
int_lists = st.sampled_from(["[]", "[0]", "[-1,2]", "[1,2]", "[0,4]", "[1000000]"])


def _override(draw, field: str) -> str:
    if field in INT_FIELDS:
        return f"{field}={draw(int_values)}"
    if field in FLOAT_FIELDS:
        return f"{field}={draw(float_values)}"
    if field in MODEL_FIELDS:
        return f"{field}={draw(model_values)}"
    return f"{field}={draw(float_lists if field == 'optim.betas' else int_lists)}"


@st.composite
def bad_runs(draw) -> tuple[list[str], str, str]:
    """A few fields of every section set to edge values, and a corpus and checkpoint directory case."""
    fields = draw(st.lists(st.sampled_from(INT_FIELDS + FLOAT_FIELDS + MODEL_FIELDS + LIST_FIELDS),
                           max_size=4, unique=True))
    return [_override(draw, f) for f in fields], draw(st.sampled_from(PATH_CASES)), draw(st.sampled_from(PATH_CASES))


def _path_case(root, case: str) -> str:
    """A path of kind ``case`` under ``root``, made on disk as the case says."""
    path = root / case
    if case == "directory":
        path.mkdir(exist_ok=True)
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "tiny":
        path.write_bytes(b"hello")
    elif case == "not_gzip.gz":
        path.write_bytes(b"plain text, not gzip")
    elif case == "file":
        path.write_bytes(b"a corpus of some length\n" * 2000)
    return str(path)


def prelaunch(*overrides: str) -> None:
    """What `orch train` checks before any worker starts, in process: `orch check` runs all but the last
    line, `orch tune` starts with check_run's first part (orch.inputs.check_inputs)."""
    from helpers.config import compose_config
    from orch.checking import checked_run
    from orch.config import to_typed
    from orch.inputs import data_fits_plan

    typed, model_cfg, _ = to_typed(compose_config(*overrides))
    estimate, _, _, workload = checked_run(typed, model_cfg)
    data_fits_plan(workload.data, estimate.plan)


@pytest.fixture(scope="module")
def path_root(tmp_path_factory):
    return tmp_path_factory.mktemp("paths")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(bad_runs())
def test_no_input_passes_prelaunch_with_anything_but_an_orch_error(path_root, run):
    overrides, data_case, checkpoint_case = run
    paths = [f"data.path={_path_case(path_root, data_case)}",
             f"train.checkpoint_dir={_path_case(path_root, checkpoint_case)}", "train.checkpoint_every=5"]
    try:
        prelaunch(*overrides, *paths)
    except OrchError as error:
        if isinstance(error, PlanError):
            assert all(v.field.split(".")[0] in SECTIONS and v.fix for v in error.violations), error


SECTIONS = {"plan", "cluster", "optim", "train", "data", "tune", "tracking", "model"}


@pytest.mark.parametrize(("override", "field"), [
    ("data.path=/no/such/corpus.txt", "data.path"), ("data.path=/", "data.path"),
    ("train.hang_timeout_s=-1", "train.hang_timeout_s"), ("train.setup_timeout_s=-5", "train.setup_timeout_s"),
    ("cluster.wait_s=0", "cluster.wait_s"), ("model.seq_len=0", "data.seq_len"), ("model.n_layer=0", "model.n_layer"),
    ("cluster.cpus_per_worker=0", "cluster.cpus_per_worker"), ("optim.lr=-0.001", "optim.lr"),
    ("data.val_fraction=1.5", "data.val_fraction"), ("data.val_fraction=0", "data.val_fraction"),
    ("optim.lr=nan", "optim.lr"), ("tune.top_k=0", "tune.top_k"), ("tracking.fallback=lcoal", "tracking.fallback"),
])
def test_each_bad_field_is_refused_before_launch_naming_it(override, field):
    with pytest.raises(PlanError) as info:
        prelaunch(override)
    assert [v.field for v in info.value.violations] == [field], info.value
    assert info.value.violations[0].fix


def test_a_checkpoint_dir_that_is_a_file_and_a_tiny_corpus_are_refused_together(tmp_path):
    (tmp_path / "ckpt").write_text("not a directory")
    (tmp_path / "tiny.txt").write_text("x" * 100)
    with pytest.raises(PlanError) as info:
        prelaunch(f"train.checkpoint_dir={tmp_path / 'ckpt'}", "train.checkpoint_every=5",
                  f"data.path={tmp_path / 'tiny.txt'}", "plan.dp=3")
    assert sorted(v.field for v in info.value.violations) == ["data.path", "plan.dp", "train.checkpoint_dir"]
    # A directory that takes no new files is refused even for root, who passes every permission check.
    with pytest.raises(PlanError) as info:
        prelaunch("train.checkpoint_dir=/proc/orch-ckpt", "train.checkpoint_every=5")
    [violation] = info.value.violations
    assert violation.field == "train.checkpoint_dir" and violation.message.startswith(
        "checkpoints cannot be written there: its closest existing parent /proc is a directory this user cannot "
        "create files in"), violation


def test_a_corpus_too_small_for_the_plans_batch_is_refused_naming_the_arithmetic(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"y" * 20_000)  # 19,000 training bytes: 148 windows of 129 bytes; 1,000 evaluation: 7
    prelaunch(f"data.path={corpus}", "plan.micro_batch_size=3")  # dp(2) * 3 = 6 windows per part
    with pytest.raises(PlanError) as info:
        prelaunch(f"data.path={corpus}", "plan.micro_batch_size=4")
    violation = info.value.violations[0]
    assert violation.field == "data.val_fraction" and "give 148 and 7 windows" in violation.message
    assert "dp * micro_batch_size = 8" in violation.fix


def test_a_models_constructor_error_names_its_argument_or_target():
    from orch.plans.model.model_facts import model_refusal

    named = model_refusal(TypeError("__init__() got an unexpected keyword argument 'width'"),
                          {"_target_": "my.Model", "width": 3}, "refused its arguments")
    assert (named.field, named.value) == ("model.width", 3) and "my.Model refused" in named.message
    anonymous = model_refusal(RuntimeError("boom"), {"_target_": "my.Model", "width": 3}, "refused its arguments")
    assert (anonymous.field, anonymous.value) == ("model._target_", "my.Model")
    assert "RuntimeError: boom" in anonymous.message
