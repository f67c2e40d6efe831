"""The one-GPU check: `orch train` on one GPU through the embedded Ray, for ~1B-parameter models.

    python -m bench.gpu_check [--markdown bench/results/gpu_smoke-<gpu>.md] [--budget-s 420] [--dry-run]

For the built-in GPT and a Llama-shaped Hugging Face model, both about 1B parameters, dp=1 in bf16
under ZeRO 0, 2 and 3, ZeRO-3 with optimizer and parameter offload to the CPU, and ZeRO-2 with
activation checkpointing. Each case is a real `orch train` command run in a scratch directory,
tracked in a local MLflow store, from which the check reads what the run recorded:

- whether the loss fell;
- the planner's predicted peak (less its allocator reserve, which CUDA's counters leave out)
  against the peak CUDA's allocator measured during the memory-probe step (target +-10%);
- the step time the tuner's cost model predicts with speeds calibrated on this GPU
  (``orch tune``'s calibration, run once per model before the cases) against the measured median;
- the run's TFLOP/s and MFU (against the matmul peak each worker measures);
- which Adam stepped the parameters (DeepSpeed's FusedAdam built with nvcc, torch's fused AdamW
  when it cannot be built, DeepSpeed's CPU Adam when offloaded).

The last case also checkpoints, and ends with `orch export` of its run, reloaded and checked
against the output the engine logged. DeepSpeed's two JIT ops are built after the speeds are
calibrated, so that the compilers do not share the host with the calibration's probes. Cases
run in order of importance and stop at ``--budget-s``: what did not fit is listed as not run.
``--dry-run`` prints the commands and needs no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import pstats
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAK_TARGET = 0.10
LOG_EVERY = 2

# ~1.0B parameters: 20 layers of d_model 2048 (12 * 20 * 2048^2), byte vocabulary.
GPT_1B = ["model=gpt", "model.n_layer=20", "model.d_model=2048", "model.n_head=16", "model.seq_len=1024"]
# TinyLlama-1.1B's shape (22 layers, hidden 2048, grouped-query attention with 4 KV heads, 32k vocabulary).
LLAMA_1B = ["model=hf_causal_lm", "model.config.hidden_size=2048", "model.config.intermediate_size=5632",
            "model.config.num_hidden_layers=22", "model.config.num_attention_heads=32",
            "model.config.num_key_value_heads=4", "model.config.vocab_size=32000",
            "model.config.max_position_embeddings=2048", "model.config.tie_word_embeddings=false",
            "data.seq_len=1024"]


@dataclass(frozen=True)
class Setup:
    """The models and sizes of a check: the GPU's, or the CPU rehearsal's (``--rehearse``: the
    shipped small models on one CPU worker, to try the check's own plumbing without a GPU)."""

    models: dict[str, list[str]]
    micro_batch: int
    seq_len: int
    steps: int

    @property
    def profiled_step(self) -> int:
        """The step run under torch's profiler (``train.profile_steps``): the last but one, warm, and
        alone in no report interval, so that the interval's step time has an unprofiled step."""
        return self.steps - 1


# The optimizer preset's learning rate (3e-3) suits the shipped small models; at 1B parameters it
# made the loss jump on an H100 (5.8 -> 11.6 -> 5.5): the check uses a 1B model's. At 3e-4 the
# Llama trained smoothly there but the 2048-wide GPT still jumped inside a 2-step warm-up (5.8 ->
# 9.2 -> 5.5, the same under every ZeRO stage), so the warm-up takes half of the 10 steps; it still
# rises there (ZeRO-2: 5.8 -> 8.2 -> 5.9). Not the GPT's initialization: on CPU (fp32, one process,
# this optimizer and schedule, 8 x 128 corpus bytes) a 4-layer GPT of width 2048 jumps right after
# its first step with a non-zero learning rate (6e-5: 6.0 -> 9.2; not at width 1024 with 8 layers).
# Each weight matrix's update alone lowers the loss; all of them together overshoot, since Adam's
# first updates move every weight by about the learning rate, a matrix's output by that times its
# width. GPT-2's scaled init of the residual projections (5.9 -> 9.8), GPT-NeoX's small init (5.8
# -> 6.9) and an untied head (5.7 -> 8.5) all still jump, as does an HF Llama of that width on bytes
# (5.8 -> 6.5); a warm-up of 50 steps does not (6.0 -> 5.1 -> 4.3). So this warm-up is short for
# the width; the Llama's 32k-vocabulary loss on the GPU may hide the same overshoot. None of this
# has run on a GPU.
ONE_BILLION_OPTIM = ["optim.lr=3e-4", "optim.warmup_steps=5"]
GPU_SETUP = Setup(models={"gpt-1b": [*GPT_1B, *ONE_BILLION_OPTIM], "llama-1b": [*LLAMA_1B, *ONE_BILLION_OPTIM]},
                  micro_batch=8, seq_len=1024, steps=10)
REHEARSAL = Setup(models={"gpt-1b": ["model=gpt"], "llama-1b": ["model=hf_causal_lm", "data.seq_len=128"]},
                  micro_batch=4, seq_len=128, steps=6)
PLANS = {
    "zero0": ["plan.zero_stage=0"],
    "zero2": ["plan.zero_stage=2"],
    "zero3": ["plan.zero_stage=3"],
    "zero3-offload": ["plan.zero_stage=3", "plan.offload_optimizer=cpu", "plan.offload_param=cpu"],
    "zero2-ac": ["plan.zero_stage=2", "plan.activation_checkpointing=true"],
    # PyTorch FSDP2 (one rank: fully_shard, bf16 MixedPrecisionPolicy and torch's fused AdamW on CUDA).
    "fsdp2": ["plan.engine=fsdp2"],
    "fsdp2-ac": ["plan.engine=fsdp2", "plan.activation_checkpointing=true"],
    # FSDP2's CPUOffloadPolicy: sharded states in pinned host memory, the optimizer stepping on the CPU.
    "fsdp2-offload": ["plan.engine=fsdp2", "plan.offload_optimizer=cpu", "plan.offload_param=cpu"],
    # torchao's float8 matmuls in the compiled blocks (tensorwise scaling): needs a GPU of compute
    # capability 8.9 or more and the machine's rates (Machine.tflops).
    "fsdp2-fp8": ["plan.engine=fsdp2", "plan.precision=fp8", "plan.compile=true"],
}
"""Each case's plan, over bf16 (a plan may name another precision)."""


@dataclass(frozen=True)
class Case:
    model: str
    plan: str
    export: bool = False
    """Checkpoint at the end, then `orch export` the run and reload the weights."""

    @property
    def name(self) -> str:
        return f"{self.model}-{self.plan}" + ("-export" if self.export else "")

    def overrides(self, setup: Setup, machine: Machine, work: Path) -> list[str]:
        extra = ["train.export=false"]
        if self.export:  # the run logs its model and the engine's output on a held-out batch, then checkpoints
            extra = ["train.export=true", f"train.checkpoint_every={setup.steps}",
                     f"train.checkpoint_dir={work / 'checkpoints' / self.name}"]
        return [*setup.models[self.model], "plan.precision=bf16", *PLANS[self.plan], *machine.cluster_overrides(),
                "plan.dp=1", f"plan.micro_batch_size={setup.micro_batch}", f"train.steps={setup.steps}",
                f"train.log_every={LOG_EVERY}", "train.eval_batches=2", f"train.profile_steps=[{setup.profiled_step}]",
                f"tracking.uri=sqlite:///{work / 'mlflow.db'}", "tracking.experiment=gpu-check",
                f"tracking.run_name={self.name}", *extra]


# In order of importance: the run stops adding cases at its time budget. The three CPU-offload
# cases first: their step time was under-predicted (0.47-0.82) until the cost model priced the
# optimizer on the worker's threads, at a rate the calibration now measures on the host, and two of
# them are ZeRO-3, whose per-module hooks the cost model charges since (neither checked on a GPU).
# Then the GPT under FSDP2 with checkpointing and under ZeRO 3 (the planner's largest peak error,
# +12.9%), the rest; the export last (1B parameters take `orch export` about 90 s on an H100 machine).
# The FP8 case third: it has never run on a GPU, nor has torchao 0.18 beside the machine's torch 2.11.
CASES = [Case("llama-1b", "fsdp2-offload"), Case("gpt-1b", "zero3-offload"), Case("llama-1b", "fsdp2-fp8"),
         Case("llama-1b", "zero3-offload"), Case("gpt-1b", "fsdp2-ac"), Case("gpt-1b", "zero3"),
         Case("llama-1b", "fsdp2"), Case("gpt-1b", "zero2"), Case("llama-1b", "zero2"), Case("llama-1b", "zero3"),
         Case("gpt-1b", "zero2-ac"), Case("llama-1b", "zero2-ac"), Case("gpt-1b", "zero0"), Case("llama-1b", "zero0"),
         Case("gpt-1b", "zero2", export=True)]


DENSE_TFLOPS = {"H100": (989.0, 1979.0), "H200": (989.0, 1979.0)}
"""Dense (bf16, FP8) TFLOP/s of the GPUs lent for the check, by a part of the name torch gives them
(the SXM parts' datasheet rates, as orch/conf/cluster/h100_8x.yaml declares them): the cost model
prices FP8 matmuls at their ratio. On another GPU the FP8 case is refused, naming the missing rate."""


@dataclass(frozen=True)
class Machine:
    gpu: str
    gpus: int
    memory_gib: float
    host_memory_gib: float
    cpus: int
    accelerator: str = "gpu"
    tflops: tuple[float, float] | None = None
    """The GPU's dense (bf16, FP8) matmul rates (``cluster.device_tflops``, ``cluster.device_fp8_tflops``;
    None: not known)."""

    @classmethod
    def probe(cls, mode: str) -> Machine:
        """This machine's GPU; or, for a dry run, an 80 GiB one; or, to rehearse, a CPU worker."""
        import psutil

        cpus = os.cpu_count() or 1
        host = psutil.virtual_memory().total / 2**30
        if mode == "dry-run":
            return cls(gpu="(dry run: an 80 GiB H100 assumed)", gpus=0, memory_gib=80.0, host_memory_gib=host,
                       cpus=cpus, tflops=DENSE_TFLOPS["H100"])
        if mode == "rehearse":
            return cls(gpu="(rehearsal: one CPU worker)", gpus=0, memory_gib=8.0, host_memory_gib=host, cpus=cpus,
                       accelerator="cpu")
        import torch

        if not torch.cuda.is_available():
            return cls(gpu="none", gpus=0, memory_gib=0.0, host_memory_gib=host, cpus=cpus)
        props = torch.cuda.get_device_properties(0)
        rates = next((rates for name, rates in DENSE_TFLOPS.items() if name in props.name), None)
        return cls(gpu=props.name, gpus=torch.cuda.device_count(), memory_gib=props.total_memory / 2**30,
                   host_memory_gib=host, cpus=cpus, tflops=rates)

    def cluster_overrides(self) -> list[str]:
        # One worker on one GPU, with the node's cores but two (the driver, Ray) for its CPU work:
        # the CPU Adam of offloaded plans runs on them.
        return [f"cluster.accelerator={self.accelerator}", "cluster.nodes=1", "cluster.devices_per_node=1",
                f"cluster.device_memory_gib={self.memory_gib:.2f}",
                f"cluster.host_memory_gib={self.host_memory_gib:.0f}",
                f"cluster.cpus_per_worker={max(1, self.cpus - 2)}", "cluster.object_store_memory_gib=8",
                *([f"cluster.device_tflops={self.tflops[0]:g}", f"cluster.device_fp8_tflops={self.tflops[1]:g}"]
                  if self.tflops else [])]


@dataclass
class Outcome:
    case: Case
    status: str = "not run"
    seconds: float = 0.0
    error: str = ""
    run_id: str = ""
    losses: list[float] = field(default_factory=list)
    step_time_s: float | None = None
    predicted_step_s: float | None = None
    predicted_parts: dict[str, float] = field(default_factory=dict)
    """The parts of the calibrated prediction (``predicted_step_s``), by name."""
    kind: str = ""
    corrected_step_s: float | None = None
    """The calibrated prediction corrected, phase by phase, by the *other* cases' runs
    (:func:`held_out_corrections`), as `orch calibrate`'s reference runs correct a profile."""
    tflops: float | None = None
    mfu: float | None = None
    measured_peak: int | None = None
    predicted_peak: int | None = None
    optimizer: str = ""
    export: str = ""
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    """(phase, predicted s, measured s) as `orch report` groups them, the prediction the run tracked."""
    profile: dict[str, float] = field(default_factory=dict)
    """The profiled step's kernel seconds by kind of work (the run's ``profile/<kind>_s``), and ``wall``."""

    @property
    def peak_error(self) -> float | None:
        if not self.measured_peak or self.predicted_peak is None:
            return None
        return (self.predicted_peak - self.measured_peak) / self.measured_peak


def orch_command() -> list[str]:
    """The installed `orch`, as a user runs it (falls back to the module beside this checkout)."""
    found = shutil.which("orch", path=os.path.dirname(sys.executable)) or shutil.which("orch")
    return [found] if found else [sys.executable, "-m", "orch"]


# ------------------------------------------------------------------------------ predicted times


def predicted_step_times(cases: list[Case], setup: Setup, machine: Machine, work: Path, log,
                         notes: list[str]) -> dict[str, tuple]:
    """Each case's predicted step (a StepTime) and the kind of plan it is
    (:func:`orch.plans.step_time.phases.correction_kind`), as the tuner's cost model predicts it
    with speeds measured on this GPU.

    Per model, the search space is the cases' own plans (dp=1, the micro-batch, ZeRO 0, 2 and 3,
    offload and activation checkpointing on and off), and the speeds are calibrated on a Ray
    worker exactly as ``orch tune`` does before its trials; one embedded Ray serves every model.
    A model whose calibration fails gets no predictions, and a note says why.
    """
    import dataclasses

    from hydra import compose, initialize_config_module

    from orch.config import register_configs, to_typed
    from orch.launchers.ray_session import ray_session
    from orch.launchers.worker_group import job_env
    from orch.plans.search.space import search
    from orch.plans.step_time.phases import correction_kind
    from orch.tune.search import measure_speeds, prepare

    register_configs()
    configs = {}
    with initialize_config_module("orch.conf", version_base="1.3"):
        for model in dict.fromkeys(c.model for c in cases):
            configs[model] = to_typed(compose("config", overrides=[
                *setup.models[model], *machine.cluster_overrides(), "plan.precision=bf16",
                f"train.global_batch_size={setup.micro_batch}", "tune.tp=[1]", "tune.pp=[1]",
                "tune.zero_stages=[0,2,3]", "tune.offload=[none,cpu]", "tune.activation_checkpointing=[false,true]",
                # The cases' own FSDP2 setting, so that a case matches one plan; compile and FP8 both ways.
                "tune.reshard_after_forward=[true]", "tune.compile=[false,true]", "tune.fp8=[false,true]",
                f"tune.micro_batch_sizes=[{setup.micro_batch}]", f"tune.cache_dir={work / 'calibration'}"]))
    first = next(iter(configs.values()))[0]
    times = {}
    with ray_session(None, worker_cpus=first.cluster.cpus_per_worker, object_store_gib=2.0,
                     worker_env=job_env(first.cluster.accelerator, first.train)):
        for model, (typed, model_cfg, _) in configs.items():
            started = time.perf_counter()
            try:
                space, ctx = prepare(typed, model_cfg, typed.cluster)
                speeds, note = measure_speeds(typed, typed.cluster, space, ctx)
                found = search(space, dataclasses.replace(ctx, speeds=speeds))
            except Exception as exc:  # noqa: BLE001 - the runs go on without this model's predictions
                notes.append(f"{model}: calibrating the cost model FAILED: {type(exc).__name__}: {str(exc)[:300]}")
                log(notes[-1])
                continue
            notes.append(f"{model}: cost model calibrated on this device in {time.perf_counter() - started:.0f} s: "
                         f"{speeds.matmul_tflops} (rows, TFLOP/s) matmul, device memory "
                         f"{speeds.device_memory_gb_per_s:.0f} GB/s, host link {speeds.host_link_gbps:.0f} Gb/s, "
                         f"host memory {speeds.host_memory_gb_per_s:.0f} GB/s, CPU Adam "
                         f"{speeds.host_optimizer_params_per_s / 1e6:.0f} M parameters/s per worker")
            log(f"{model}: speeds {note}: {json.dumps(dataclasses.asdict(speeds))}")
            for case in cases:
                if case.model != model:
                    continue
                want = plan_key(PLANS[case.plan])
                for candidate in found.ranked:
                    if case_plan_key(candidate.plan) == want:
                        times[case.name] = (candidate.predicted, correction_kind(candidate.plan))
    return times


def held_out_corrections(outcomes: list[Outcome]) -> None:
    """Set each finished case's calibrated prediction corrected by the other cases' runs alone: each
    case is a run of one kind (engine, its settings, offload), and its measured phases against the
    calibrated prediction's parts correct the others as `orch calibrate`'s reference runs do (the same
    kind's runs first: the other model's case of that plan). Held out, so no case is predicted from
    its own run (orch/plans/step_time/profile.py held_out_predictions)."""
    from orch.plans.spec import PhaseObservation, RunObservation
    from orch.plans.step_time.phases import PHASES_VERSION, phase_groups
    from orch.plans.step_time.profile import held_out_predictions

    runs, by_run = [], {}
    for o in outcomes:
        if o.status != "ok" or not o.phases or not o.predicted_parts:
            continue
        measured = {name: seconds for name, _, seconds in o.phases}
        groups = phase_groups("pipeline schedule" in measured)
        phases = [PhaseObservation(phase=g.name, predicted_s=sum(o.predicted_parts.get(part, 0.0) for part in g.parts),
                                   measured_s=measured[g.name]) for g in groups if g.name in measured]
        run = RunObservation(run_id=o.run_id, plan=o.case.plan, recorded_at="", phases=phases, kind=o.kind,
                             phases_version=PHASES_VERSION)
        runs.append(run)
        by_run[id(run)] = o
    if len(runs) < 2:
        return
    for run, predicted, measured in held_out_predictions(runs):
        outcome = by_run[id(run)]
        # The phases left out of the prediction (the step's own bookkeeping) add what they measured.
        outside = (outcome.step_time_s or measured) - measured
        outcome.corrected_step_s = predicted + max(outside, 0.0)


def plan_key(overrides: list[str]) -> tuple:
    """(engine, zero stage, optimizer offload, parameter offload, recomputation, precision, compile) of a
    case's plan overrides, over the check's bf16 and the plan's defaults."""
    from orch.plans.spec import Recompute

    values = dict(o.split("=", 1) for o in overrides)
    return (values.get("plan.engine", "deepspeed"), int(values.get("plan.zero_stage", 0)),
            values.get("plan.offload_optimizer", "none"),
            values.get("plan.offload_param", "none"), Recompute.of(values.get("plan.activation_checkpointing", "none")),
            values.get("plan.precision", "bf16"), values.get("plan.compile", "false") == "true")


def case_plan_key(plan) -> tuple:
    """:func:`plan_key` of a resolved plan (the tuner's candidates)."""
    return (plan.engine, plan.zero_stage, plan.offload_optimizer.value, plan.offload_param.value,
            plan.activation_checkpointing, plan.precision.value, plan.compile)


# --------------------------------------------------------------------------------- the runs


def read_run(outcome: Outcome, tracking_uri: str) -> None:
    """Fill ``outcome`` from what its MLflow run recorded."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("gpu-check")
    runs = client.search_runs([experiment.experiment_id], f"tags.`mlflow.runName` = '{outcome.case.name}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        return
    run = runs[0]
    outcome.run_id = run.info.run_id

    def history(key: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    outcome.losses = history("loss")
    # The first interval holds the warm-up and the memory-probe step: the steady state is the rest.
    steady = history("step_time_s")[1:]
    outcome.step_time_s = statistics.median(steady) if steady else None
    tflops, mfu = history("tflops_per_device")[1:], history("mfu")[1:]
    outcome.tflops = statistics.median(tflops) if tflops else None
    outcome.mfu = statistics.median(mfu) if mfu else None
    peaks = history("memory/measured_peak_bytes")
    outcome.measured_peak = int(max(peaks)) if peaks else None
    outcome.optimizer = run.data.tags.get("optimizer", "")
    outcome.profile = {key.removeprefix("profile/").removesuffix("_s"): value for key, value in run.data.metrics.items()
                       if key.startswith("profile/") and not key.startswith("profile/rank")}
    from orch.tracking.step_prediction import phase_comparisons

    outcome.phases = [(c.name, c.predicted_s, c.measured_s)
                      for c in phase_comparisons(client, run.info.run_id, run.data.params, run.data.metrics)]
    with tempfile.TemporaryDirectory() as tmp:
        estimate = json.loads(Path(client.download_artifacts(run.info.run_id, "plan/estimate.json", tmp)).read_text())
    # CUDA's allocator counts allocated bytes; the planner's reserve is the cache it keeps beyond them.
    outcome.predicted_peak = max(s["total"] - s["reserve"] for s in estimate["stages"])


def run_case(case: Case, setup: Setup, machine: Machine, work: Path, timeout_s: float, log) -> Outcome:
    outcome = Outcome(case)
    # --verbose: a failure's whole traceback goes to the case's log.
    command = [*orch_command(), "train", "--verbose", *case.overrides(setup, machine, work)]
    log(f"$ {shlex.join(command)}")
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=timeout_s)
        output = done.stdout + done.stderr
        outcome.status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        outcome.status = f"timed out after {timeout_s:.0f} s"
    outcome.seconds = time.perf_counter() - started
    (work / f"{case.name}.log").write_text(output)
    if outcome.status != "ok":
        outcome.error = last_error(output)
    try:
        read_run(outcome, f"sqlite:///{work / 'mlflow.db'}")
    except Exception as exc:  # noqa: BLE001 - a run that failed early has nothing to read
        outcome.error = outcome.error or f"reading its MLflow run: {type(exc).__name__}: {exc}"
    if case.export and outcome.status == "ok":
        try:
            outcome.export = export_and_reload(outcome, setup, work, log)
        except Exception as exc:  # noqa: BLE001 - reported in the results, the other cases go on
            outcome.export = f"reloading the export FAILED: {type(exc).__name__}: {str(exc)[:300]}"
    log(f"{case.name}: {outcome.status} in {outcome.seconds:.0f} s" + (f": {outcome.error}" if outcome.error else ""))
    return outcome


def profile_check(case: Case, setup: Setup, machine: Machine, work: Path, log) -> str:
    """`orch check` of ``case`` under cProfile: its functions by cumulative time go to
    check-profile.log, and the note says how long it took. On an H100 machine `orch train` spent
    14-22 s in its check phase, against about 3 s on the 2-core CPU machines, and nothing here
    shows why without a GPU."""
    profile = work / "check.prof"
    command = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "orch", "check",
               *case.overrides(setup, machine, work)]
    log(f"$ {shlex.join(command)}")
    started = time.perf_counter()
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - started
    listing = io.StringIO()
    if profile.exists():
        pstats.Stats(str(profile), stream=listing).sort_stats("cumulative").print_stats(60)
    (work / "check-profile.log").write_text(done.stdout[-4000:] + done.stderr[-4000:] + listing.getvalue())
    return (f"`orch check` of {case.name} under cProfile: {seconds:.1f} s, exit {done.returncode} "
            "(functions by cumulative time: check-profile.log)")


def last_error(output: str) -> str:
    """The line of a failed command's output that says what went wrong: the innermost exception
    of a traceback, else the last line that reads like an error."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b.*:", line):
            return line[:400]
    for line in reversed(lines):
        if re.search(r"Error|error:|Exception|refused|out of memory", line):
            return line[:400]
    return lines[-1][:400] if lines else "(no output)"


def export_and_reload(outcome: Outcome, setup: Setup, work: Path, log) -> str:
    """`orch export` of the run, the weights loaded into a fresh model and checked against the
    output the engine logged on a held-out batch at the end of the run."""
    import torch
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file, load_model

    uri = f"sqlite:///{work / 'mlflow.db'}"
    out = work / "export" / outcome.case.name
    # The model comes from the command's own config, as the run's (orch export trusts no tracked config).
    command = [*orch_command(), "export", outcome.run_id, "--out", str(out), *setup.models[outcome.case.model],
               f"tracking.uri={uri}"]
    log(f"$ {shlex.join(command)}")
    started = time.perf_counter()
    done = subprocess.run(command, cwd=work, capture_output=True, text=True)
    (work / f"{outcome.case.name}-export.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return f"`orch export` failed (exit {done.returncode}): {last_error(done.stdout + done.stderr)}"
    seconds = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        check = load_file(MlflowClient(uri).download_artifacts(outcome.run_id, "model/check.safetensors", tmp))
    from orch.workloads.gpt import GPT

    values = dict(o.split("=", 1) for o in setup.models[outcome.case.model] if o.startswith("model."))
    model = GPT(**{k.removeprefix("model."): int(v) for k, v in values.items() if k != "model"})
    load_model(model, str(out / "model.safetensors"))
    with torch.no_grad():
        output = model.eval()(check["batch.0"])
    error = ((output - check["output"].float()).norm() / check["output"].float().norm()).item()
    # The engine's output is bf16; the reloaded model runs in fp32 on the CPU.
    verdict = "matches" if error < 2e-2 else "DIFFERS from"
    return (f"`orch export` in {seconds:.0f} s; the reloaded fp32 model {verdict} the engine's bf16 output "
            f"on the held-out batch (relative error {error:.2e})")


# ------------------------------------------------------------------------------ the report


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def report(setup: Setup, machine: Machine, versions: str, outcomes: list[Outcome], notes: list[str],
           started_at: str, wall_s: float) -> str:
    gib = 2**30
    lines = ["# GPU check: ~1B-parameter models on one GPU", "",
             f"- date: {started_at}, {wall_s / 60:.1f} minutes; host {platform.node()}",
             f"- GPU: {machine.gpus} x {machine.gpu} ({machine.memory_gib:.1f} GiB); {machine.cpus} CPU cores, "
             f"{machine.host_memory_gib:.0f} GiB host memory",
             f"- {versions}",
             f"- every case: `orch train` dp=1, bf16, micro-batch {setup.micro_batch} x {setup.seq_len} tokens, "
             f"{setup.steps} steps "
             f"(step time and MFU: median of the logged intervals after the first); command: "
             "`python -m bench.gpu_check` (bench/gpu_smoke.sh)", "",
             "| case | status | loss first → last | falls | predicted peak GiB | measured peak GiB | error | "
             "predicted step s | measured step s | ratio | corrected by the other cases s | ratio | TFLOP/s | MFU | "
             "optimizer |",
             "|---|---|---|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for o in outcomes:
        falls = "-" if len(o.losses) < 2 else ("yes" if o.losses[-1] < o.losses[0] else "**no**")
        losses = f"{o.losses[0]:.3f} → {o.losses[-1]:.3f}" if o.losses else "-"
        err = o.peak_error
        err_text = "-" if err is None else (f"{err:+.1%}" if abs(err) <= PEAK_TARGET else f"**{err:+.1%}**")
        ratio = (o.predicted_step_s / o.step_time_s) if o.predicted_step_s and o.step_time_s else None
        corrected = (o.corrected_step_s / o.step_time_s) if o.corrected_step_s and o.step_time_s else None
        lines.append(
            f"| {o.case.name} | {o.status} | {losses} | {falls} | "
            f"{fmt(o.predicted_peak and o.predicted_peak / gib, '.2f')} | "
            f"{fmt(o.measured_peak and o.measured_peak / gib, '.2f')} | {err_text} | "
            f"{fmt(o.predicted_step_s, '.3f')} | {fmt(o.step_time_s, '.3f')} | {fmt(ratio, '.2f')} | "
            f"{fmt(o.corrected_step_s, '.3f')} | {fmt(corrected, '.2f')} | "
            f"{fmt(o.tflops, '.0f')} | {fmt(o.mfu, '.1%')} | {o.optimizer or '-'} |")
    phased = [o for o in outcomes if o.phases]
    if phased:
        from orch.plans.step_time.phases import phase_groups

        groups = {g.name: g.parts for g in phase_groups(pipelined=False)}
        lines += ["", "## Step time by phase", "",
                  "Each run's own tracked prediction (at the speeds it trained with: declared unless a cluster "
                  "profile was given) and the prediction at the speeds calibrated on this GPU, against the phases "
                  "it timed (`orch report`'s grouping; one step in ten timed, each phase ending in a device "
                  "synchronisation).", "",
                  "| case | phase | tracked prediction s | calibrated prediction s | measured s | "
                  "measured / tracked | measured / calibrated |", "|---|---|---:|---:|---:|---:|---:|"]
        for o in phased:
            for name, predicted, measured in o.phases:
                ratio = measured / predicted if predicted else None
                calibrated = (sum(o.predicted_parts.get(part, 0.0) for part in groups.get(name, ()))
                              if o.predicted_parts else None)
                against = measured / calibrated if calibrated else None
                lines.append(f"| {o.case.name} | {name} | {predicted:.4f} | {fmt(calibrated, '.4f')} | "
                             f"{measured:.4f} | {fmt(ratio, '.2f')} | {fmt(against, '.2f')} |")
    profiled = [o for o in outcomes if o.profile]
    if profiled:
        kinds = ["matmul", "attention", "elementwise", "communication", "copies", "optimizer"]
        lines += ["", f"## Step {setup.profiled_step} under torch's profiler", "",
                  "Kernel time by kind of work (`train.profile_steps`: each kernel under the operator that launched "
                  "it; the optimizer's, whatever runs inside torch's `Optimizer.step`), beside the calibrated "
                  "prediction's parts that price the same work: compute (matmuls and attention), memory-bound "
                  "kernels, and the optimizer step with its offload copies. The profiler slows the step (wall).", "",
                  "| case | wall s | " + " | ".join(f"{k} s" for k in kinds) + " | predicted compute s | "
                  "predicted memory-bound s | predicted optimizer + offload s |",
                  "|---|" + "---:|" * (len(kinds) + 4)]
        for o in profiled:
            parts = o.predicted_parts
            lines.append(f"| {o.case.name} | {fmt(o.profile.get('wall'), '.4f')} | "
                         + " | ".join(fmt(o.profile.get(k), '.4f') for k in kinds) + " | "
                         f"{fmt(parts.get('compute'), '.4f')} | {fmt(parts.get('memory'), '.4f')} | "
                         f"{fmt(parts and parts.get('optimizer', 0.0) + parts.get('offload', 0.0), '.4f')} |")
    problems = [f"- **{o.case.name}**: {o.error}" for o in outcomes if o.error]
    exports = [f"- {o.case.name}: {o.export}" for o in outcomes if o.export]
    if exports:
        lines += ["", "## Export", "", *exports]
    if problems:
        lines += ["", "## Failures", "", *problems]
    if notes:
        lines += ["", "## Notes", "", *(f"- {n}" for n in notes)]
    lines += ["", "Error: (predicted - measured) / measured, target ±10% (the predicted peak less the allocator "
              "reserve). Ratio: predicted / measured step time (target after calibration: 0.85-1.15). Corrected by "
              "the other cases: the calibrated prediction with each phase scaled by the other cases' runs "
              "(the same plan's on the other model first), as `orch calibrate`'s reference runs correct a profile. "
              "Logs of every command: the `*.log` files "
              "beside the results when run by bench/gpu_smoke.sh."]
    return "\n".join(lines) + "\n"


def versions_line() -> str:
    from importlib.metadata import version

    names = ["torch", "deepspeed", "ray", "mlflow", "hydra-core", "transformers"]
    return ", ".join(f"{n} {version(n)}" for n in names) + f", Python {platform.python_version()}"


def prebuild_ops(work: Path) -> list[tuple[str, subprocess.Popen, float]]:
    """Start building DeepSpeed's FusedAdam (nvcc) and CPU Adam (host compiler) into torch's
    extension cache, so that the cases load them instead of each building one in its setup."""
    from orch.launchers.engines.deepspeed.config import deepspeed_arch_list

    env = dict(os.environ)
    if env.get("TORCH_CUDA_ARCH_LIST"):  # as the workers give it to DeepSpeed (orch/launchers/gpu_worker.py)
        env["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(env["TORCH_CUDA_ARCH_LIST"])
    builds = []
    for op in ("FusedAdamBuilder", "CPUAdamBuilder"):
        log = (work / f"build-{op}.log").open("w")
        # The builder CI prebuilds its CPU ops with: one op into torch's extension cache.
        command = [sys.executable, str(REPO / ".ci" / "build_deepspeed_ops.py"), op]
        builds.append((op, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env),
                       time.perf_counter()))
    return builds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", type=Path, help="write the results here (and the logs beside it)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="start no case after this many seconds")
    parser.add_argument("--case-timeout-s", type=float, default=180.0)
    parser.add_argument("--only", nargs="*", help="case names to run, in this order (default: all)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print what would run; needs no GPU")
    mode.add_argument("--rehearse", action="store_true",
                      help="run the whole check on one CPU worker with the shipped small models (no GPU)")
    args = parser.parse_args(argv)
    by_name = {c.name: c for c in CASES}
    if unknown := [name for name in args.only or [] if name not in by_name]:
        parser.error(f"unknown cases {unknown}; the cases: {', '.join(by_name)}")
    cases = [by_name[name] for name in args.only] if args.only else CASES
    setup = REHEARSAL if args.rehearse else GPU_SETUP
    machine = Machine.probe("dry-run" if args.dry_run else "rehearse" if args.rehearse else "gpu")
    work = Path(tempfile.mkdtemp(prefix="orch-gpu-check-"))
    if args.dry_run:
        print(f"would calibrate the cost model's speeds for {', '.join(sorted({c.model for c in cases}))}, then "
              f"build DeepSpeed's FusedAdam and CPU Adam, then run in {work}, within {args.budget_s:.0f} s:")
        for case in cases:
            print(f"  {case.name}: {shlex.join([*orch_command(), 'train', *case.overrides(setup, machine, work)])}")
            if case.export:
                print(f"  {case.name}: {shlex.join([*orch_command(), 'export', 'RUN_ID', '--out', 'DIR'])}, "
                      "then reload the weights and compare with the engine's output")
        shutil.rmtree(work)
        return 0
    if machine.gpus == 0 and not args.rehearse:
        print("no CUDA GPU visible to torch: nothing to check (--dry-run shows what would run)", file=sys.stderr)
        return 2
    started, started_at = time.perf_counter(), datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    transcript: list[str] = []

    def log(line: str) -> None:
        stamp = f"[{time.perf_counter() - started:6.1f}s] {line}"
        transcript.append(stamp)
        print(stamp, file=sys.stderr, flush=True)

    notes: list[str] = []
    # Calibrated on a quiet host, before the builds: on an H200 machine a calibration taken while
    # the compilers ran read host memory at 16 GB/s instead of about 195 and the CPU Adam rate at
    # half (bench/results/gpu_smoke-nvidia-h200.md), which mispredicted every offloaded case.
    try:
        predicted = predicted_step_times(cases, setup, machine, work, log, notes)
    except Exception as exc:  # noqa: BLE001 - the runs go on without predictions
        predicted = {}
        notes.append(f"calibrating the cost model FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        log(notes[-1])
    builds = [] if args.rehearse else prebuild_ops(work)
    for op, process, t0 in builds:
        code = process.wait()
        notes.append(f"DeepSpeed {op}: " + ("built" if code == 0 else f"build FAILED (exit {code})")
                     + f" in {time.perf_counter() - t0:.0f} s (see build-{op}.log)")
        log(notes[-1])

    def write(outcomes: list[Outcome]) -> str:
        """The report so far: written after every case, so a check stopped from outside keeps
        what it measured."""
        done = {o.case.name for o in outcomes}
        pending = [Outcome(c, status="not run") for c in cases if c.name not in done]
        text = report(setup, machine, versions_line(), outcomes + pending, notes, started_at,
                      time.perf_counter() - started)
        if args.markdown:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(text)
            logs = args.markdown.with_suffix(".logs")
            logs.mkdir(exist_ok=True)
            for path in work.glob("*.log"):
                shutil.copy2(path, logs / path.name)
            (logs / "transcript.log").write_text("\n".join(transcript) + "\n")
        return text

    outcomes: list[Outcome] = []
    write(outcomes)
    for case in cases:
        elapsed = time.perf_counter() - started
        if elapsed > args.budget_s:
            outcomes.append(Outcome(case, status=f"not run (budget {args.budget_s:.0f} s spent)"))
            continue
        outcome = run_case(case, setup, machine, work, args.case_timeout_s, log)
        if case.name in predicted:
            step, outcome.kind = predicted[case.name]
            outcome.predicted_step_s, outcome.predicted_parts = step.total_s, step.as_dict()["parts_s"]
        outcomes.append(outcome)
        held_out_corrections(outcomes)
        write(outcomes)
    try:
        notes.append(profile_check(cases[0], setup, machine, work, log))
    except Exception as exc:  # noqa: BLE001 - a diagnosis, not a case
        notes.append(f"profiling `orch check` FAILED: {type(exc).__name__}: {str(exc)[:300]}")
    log(notes[-1])
    print(write(outcomes))
    failed = [o for o in outcomes if o.status != "ok" and not o.status.startswith("not run")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
