"""The root config schema, registered in Hydra's ConfigStore.

The YAML files under ``orch/conf/`` extend these schemas, so a mistyped key or a wrongly typed value
fails when Hydra composes the config, naming the key. The plan, cluster, optimizer, data and
loop schemas live in :mod:`orch.plans.spec` (pure dataclasses the planner uses directly).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

from orch.model_sources import prefer_command_line_source
from orch.plans.errors import OrchError
from orch.plans.spec import ClusterSpec, OptimSpec, PlanSpec, TrainSpec
from orch.workloads.ray_data import RayDataConfig
from orch.workloads.schemas import (
    CorpusDataConfig,
    DatasetDataConfig,
    HFCausalLMConfig,
    ImagesDataConfig,
    TextDataConfig,
    TorchvisionModelConfig,
)


@dataclass(kw_only=True)
class GPTModelConfig:
    """The built-in GPT (orch/workloads/gpt.py)."""

    _target_: str = "orch.workloads.gpt.GPT"
    n_layer: int = 2
    """Transformer blocks."""
    d_model: int = 128
    """Hidden size."""
    n_head: int = 4
    """Attention heads; must divide d_model."""
    seq_len: int = 128
    """Context length (learned positions)."""
    vocab_size: int = 256
    """Vocabulary; the byte-level corpus needs at least 256."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head."""
    dropout: float = 0.0
    """Dropout on the attention probabilities and on each sublayer's output (GPT-3 and Megatron-LM
    trained with 0.1)."""
    fused_attention: bool = True
    """Attention through scaled_dot_product_attention's fused kernels; false writes the scores and
    runs softmax and dropout over them, as Megatron-LM did before fused attention kernels."""
    tp: int = II("plan.tp")
    """Tensor-parallel degree the model is sharded over; follows plan.tp (the model checks that
    model.n_head divides by it, so a bad plan.tp fails in the planner, naming both)."""


@dataclass(kw_only=True)
class ObjectiveConfig:
    """A shipped objective: no arguments besides its class."""

    _target_: str


@dataclass(kw_only=True)
class TrackingConfig:
    """Where the run is recorded."""

    uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI: a local sqlite file by default, or http://host:5000 for a server. A server's
    credentials go in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD; a user:password@ written here
    is moved there before anything is recorded."""
    experiment: str = "orch"
    """MLflow experiment name."""
    run_name: str | None = None
    """MLflow run name; null lets MLflow pick one."""
    enabled: bool = True
    """false runs without tracking (benchmarks use it as a baseline)."""
    fallback: str | None = None
    """local: when the tracking server is unreachable at start, track in sqlite:///mlflow.db
    with a warning instead of failing."""
    system_metrics_interval_s: float = 10.0
    """Seconds between samples of every node's CPU, memory, disk, network and GPU use, logged as
    system/node<i>/<metric> (MLflow's system metrics, one series per node), plus one when a node's
    training ends; 0 turns them off."""


@dataclass(kw_only=True)
class TuneConfig:
    """`orch tune`: the search space it may vary, the short trials, and where the winner goes."""

    trials: int = 0
    """Run this many plans as short real trials (the best predicted of each layout first) and pick the best
    measured (0: predict only)."""
    trial_steps: int = 8
    """Optimizer steps per trial; the first and the memory-probe step are not timed."""
    trial_timeout_s: float = 300.0
    """A trial still running (or stuck) after this long is stopped and reported; tuning goes on."""
    top_k: int = 10
    """Candidates shown in the table (and in --json); all are ranked."""
    out: str | None = None
    """The winning plan file; null: ./tuned_plans/plan/<name>.yaml in the current directory. A file in a
    directory named plan/ is usable as plan=<its name> (`orch train --config-dir <that directory's parent>
    plan=<name>`, the command `orch tune` prints); the installed package is never written to. A URI
    (s3://bucket/plans/tuned.yaml) writes it to object storage."""
    name: str = "tuned"
    """Name of the winning plan file (and of the plan=<name> option) when tune.out is null."""
    calibrate: bool = True
    """Measure matmul, memory and all-reduce speeds on the Ray workers when Ray is used (an address,
    or trials); false, or without Ray: the cluster's declared speeds."""
    cache_dir: str = "~/.cache/orch"
    """Where measured cluster speeds are cached (one file per cluster)."""
    tp: list[int] | None = None
    """Tensor-parallel degrees to try; null: every divisor of the world size."""
    pp: list[int] | None = None
    """Pipeline degrees to try; null: every divisor of the world size."""
    zero_stages: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    offload: list[str] = field(default_factory=lambda: ["none", "cpu"])
    """Where optimizer states and (ZeRO-3) parameters may go: none, cpu."""
    activation_checkpointing: list[bool | str] = field(default_factory=lambda: ["none", "selective", "full"])
    """Recomputation policies to try: none, selective, full (true/false: full/none); a model with
    nothing to checkpoint is tried with none only, one whose own switch takes no policy without selective."""
    recompute_every_n_layers: list[int] = field(default_factory=lambda: [1])
    """plan.recompute_every_n_layers values to try with each recomputation policy but none (e.g. [1,2,4]:
    every block, every 2nd, every 4th; pipelines on deepspeed every block only)."""
    micro_batch_sizes: list[int] | None = None
    """Micro-batches to try; null: every power of two dividing the per-replica batch."""
    engines: list[str] = field(default_factory=lambda: ["deepspeed", "fsdp2"])
    """Training engines to try: deepspeed (its ZeRO stages, pipelines) and fsdp2 (plan.engine)."""
    reshard_after_forward: list[bool] = field(default_factory=lambda: [True, False])
    """FSDP2's plan.fsdp.reshard_after_forward values to try (fsdp2 plans only)."""
    compile: list[bool] = field(default_factory=lambda: [False, True])
    """plan.compile values to try (true with engines that compile: fsdp2)."""
    sequence_parallel: list[bool] = field(default_factory=lambda: [True])
    """plan.sequence_parallel values to try where it applies (tp > 1, engines that split the sequence:
    fsdp2; elsewhere false). The cost model never prices a split sequence above an unsplit one (the same
    bytes on the wire, less memory and memory-bound work), so by default only the split is tried;
    [false,true] tries both."""
    fp8: list[bool] = field(default_factory=lambda: [False, True])
    """With plan.precision=bf16: whether to try plan.precision=fp8 as well ([false,true]), or instead
    ([true]), where the cluster declares FP8 matmuls (cluster.device_fp8_tflops, GPUs) and the engine
    trains in it (fsdp2); elsewhere bf16 only."""
    async_tp: list[bool] = field(default_factory=lambda: [False, True])
    """plan.async_tp values to try where it applies (GPU clusters, engines that overlap tensor-parallel
    collectives: fsdp2, with tp > 1, sequence parallelism and compile; elsewhere false)."""
    cp: list[int] | None = None
    """Context-parallel degrees to try (fsdp2, with and without pipeline stages); null: 1, and for sequences of
    more than 16K tokens the powers of two up to 8 that leave each rank at least 16K of them
    (below that the gathers of keys and values are not worth their latency)."""
    pp_schedule: list[str] = field(default_factory=lambda: ["1f1b", "interleaved_1f1b", "zero_bubble", "zbv"])
    """Pipeline schedules to try with pp > 1, each where an engine runs it (deepspeed: 1f1b only)."""
    pp_virtual_stages: list[int] = field(default_factory=lambda: [2, 4])
    """Stages per rank to try with the interleaved schedules (interleaved_1f1b, zero_bubble; zbv takes 2)."""


@dataclass(kw_only=True)
class CalibrateConfig:
    """`orch calibrate`: where the cluster profile it measures goes, and the short runs it trains to
    correct it."""

    name: str = "calibrated"
    """Name of the profile (the cluster=<name> option) when calibrate.out is null."""
    out: str | None = None
    """The profile file; null: ./tuned_plans/cluster/<name>.yaml, selected with `--config-dir tuned_plans
    cluster=<name>` (the directory `orch tune` writes its plans to). A file in a directory named cluster/ is
    usable as cluster=<its name> with --config-dir <that directory's parent>; never inside the installed
    package."""
    references: list[dict[str, Any]] | None = None
    """The reference runs: each trains the declared plan with these plan.* keys changed (engine, ZeRO stage,
    offload are reset first) for calibrate.reference_steps steps, and its phases, measured against the
    profile's prediction, correct plans of its kind (engine, engine settings, optimizer offload); the probes
    alone do not see an engine's own work (hooks, bucketed reductions, gathers). One that does not fit is
    skipped, and says why. null: DeepSpeed ZeRO 0-3, ZeRO-2 with CPU offload and FSDP2
    (orch/reference_runs.py DEFAULT_REFERENCES); []: probes only."""
    reference_steps: int = 10
    """Steps of each reference run; the later half's phases are compared (the first carry warm-up)."""


@dataclass(kw_only=True)
class SubmitConfig:
    """`orch submit`: what the Ray Job ships with the run (its runtime environment)."""

    working_dir: str | None = None
    """The directory shipped to the cluster as the job's working directory (your model, objective
    and data code, a --config-dir inside it); null: the current directory."""
    excludes: list[str] = field(default_factory=lambda: [
        ".git", ".venv", "__pycache__", "mlflow.db", "mlruns", "outputs", "multirun", "checkpoints", "reports",
        # Secrets a project directory often holds: shipped, they would sit in the cluster's
        # package store for anyone on it to read.
        ".env", ".env.*", ".netrc", ".ssh", ".aws", "*.pem", "*.key", "id_rsa*", "id_ed25519*", "id_ecdsa*"])
    """Paths of working_dir not shipped (gitignore-style patterns, as Ray's runtime_env takes them);
    the defaults also leave out .env files, private keys and credential directories."""
    pip: list[str] = field(default_factory=list)
    """Extra pip packages installed for the job on every node (orch itself must be installed there)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of the job's driver and workers. Never credentials: Ray keeps a
    job's runtime environment in its job table, readable by anyone who can list jobs."""


@dataclass(kw_only=True)
class RunConfig:
    """The whole declaration of a run: one field per config group, plus the loop."""

    model: Any = MISSING
    """The model: ``_target_`` (a torch.nn.Module class or factory) and its arguments."""
    data: Any = MISSING
    """The data source: ``_target_`` (a orch.plans.model.workload.DataSource class) and its arguments."""
    objective: Any = MISSING
    """The loss: ``_target_`` of a class (instantiated with its arguments) or of a function, called
    as ``(outputs, batch) -> loss``."""
    plan: PlanSpec = field(default_factory=PlanSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    train: TrainSpec = field(default_factory=TrainSpec)
    tune: TuneConfig = field(default_factory=TuneConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    submit: SubmitConfig = field(default_factory=SubmitConfig)


SCHEMA_SUFFIX = "_schema"
"""How the name of every registered schema ends: the YAML files extend them, nobody selects them."""


def config_groups_help() -> str:
    """``group: option, ...`` for each config group, as ``--help`` lists them (``hydra.help.template``
    in config.yaml), without the schemas, which are registered in the groups but are no option."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return ""
    loader = GlobalHydra.instance().config_loader()
    lines, todo = [], loader.list_groups("")
    while todo:
        group = todo.pop()
        if group == "hydra":
            continue
        todo += [f"{group}/{child}" for child in loader.list_groups(group)]
        options = [o for o in loader.get_group_options(group) if not o.endswith(SCHEMA_SUFFIX)]
        if options:
            lines.append(f"{group}: {', '.join(sorted(options))}")
    return "\n".join(sorted(lines))


def _shipped_hf_config(name: str) -> str:
    """``${orch_hf_config:NAME}``: the path of a Hugging Face config.json shipped with the presets."""
    from orch.workloads.hf_presets import preset_config_path

    return preset_config_path(name)


def register_configs() -> None:
    """Register the schemas; the YAML files list them first in their defaults."""
    OmegaConf.register_new_resolver("orch_config_groups", config_groups_help, replace=True)
    OmegaConf.register_new_resolver("orch_hf_config", _shipped_hf_config, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="model", name="gpt_schema", node=GPTModelConfig)
    cs.store(group="plan", name="plan_schema", node=PlanSpec)
    cs.store(group="cluster", name="cluster_schema", node=ClusterSpec)
    cs.store(group="optim", name="optim_schema", node=OptimSpec)
    cs.store(group="data", name="corpus_schema", node=CorpusDataConfig)
    cs.store(group="data", name="images_schema", node=ImagesDataConfig)
    cs.store(group="data", name="text_schema", node=TextDataConfig)
    cs.store(group="data", name="dataset_schema", node=DatasetDataConfig)
    cs.store(group="data", name="ray_schema", node=RayDataConfig)
    cs.store(group="model", name="torchvision_schema", node=TorchvisionModelConfig)
    cs.store(group="model", name="hf_causal_lm_schema", node=HFCausalLMConfig)
    cs.store(group="objective", name="causal_lm_schema",
             node=ObjectiveConfig(_target_="orch.workloads.objectives.CausalLM"))
    cs.store(group="objective", name="classification_schema",
             node=ObjectiveConfig(_target_="orch.workloads.objectives.Classification"))
    cs.store(group="tracking", name="tracking_schema", node=TrackingConfig)


class ConfigError(OrchError):
    """A composed config that does not match its schema."""


def _unknown_keys(node: DictConfig, prefix: str) -> Iterator[str]:
    """Keys a typed node does not declare.

    Hydra's ``+key=value`` appends keys even to structured nodes, and ``OmegaConf.to_object``
    then drops them silently; a typo must fail instead.
    """
    schema = OmegaConf.get_type(node)
    declared = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        name = f"{prefix}{key}"
        if declared is not None and key not in declared:
            yield (f"{name}: {schema.__name__} has no key {key!r}; remove it or fix the spelling "
                   f"(known keys: {', '.join(sorted(declared))})")
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            yield from _unknown_keys(child, f"{name}.")


def to_typed(cfg: DictConfig) -> tuple[RunConfig, dict, str]:
    """The composed config as typed dataclasses, the model config as a plain dict, and its YAML.

    The model, data and objective stay plain dicts (``typed.data``, ``typed.objective``) because
    they are instantiated through their ``_target_``, and the workers must not depend on Hydra's
    config objects.
    """
    prefer_command_line_source(cfg)  # a model source the command line names replaces the group's own
    unknown = list(_unknown_keys(cfg, ""))
    if unknown:
        raise ConfigError("unknown config key(s):\n" + "\n".join(f"  - {u}" for u in unknown))
    yaml = OmegaConf.to_yaml(cfg, resolve=True)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    typed = OmegaConf.to_object(cfg)
    typed.data = OmegaConf.to_container(cfg.data, resolve=True)
    typed.objective = OmegaConf.to_container(cfg.objective, resolve=True)
    return typed, model_cfg, yaml
