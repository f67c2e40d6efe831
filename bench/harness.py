"""What the side-by-side benchmarks share: their common options, launching a training command,
timestamping its step lines, reducing them to step times, and writing the result table with the
machine it ran on.

Every runner compared here (``orch train``, ``torchrun`` with a plain DeepSpeed script, Ray
Train) prints one ``step N/T ...`` line per step. The benchmark reads those lines as they come
and notes when each arrived, so all runners are timed the same way, from the outside, from the
moment the command was launched. A line may carry its own ``t=<unix time>`` stamp (the plain
loop adds one), which is used instead of the arrival time: Ray forwards worker output through its
log monitor, and that forwarding delay is not the runner's training time.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
STEP_LINE = re.compile(r"step (\d+)/(\d+)\b(?:.*?\bt=(\d+\.\d+))?")


class BenchError(RuntimeError):
    """A benchmarked command failed; the message carries the tail of its output."""


@dataclass
class TimedRun:
    """One launched command: when each step's line appeared (seconds after launch) and its output."""

    label: str
    step_at: dict[int, float] = field(default_factory=dict)
    """Seconds after launch at which step N was reported (the first report of N wins)."""
    wall_s: float = 0.0
    """Launch to exit, teardown included."""
    output: list[str] = field(default_factory=list)
    cpu_to_first_step_s: float | None = None
    """CPU seconds every process on the machine used from launch until the first step's line
    arrived (None where the kernel does not say): start-up on a machine whose cores were busy
    the whole time is bound by the work done, not by waiting."""

    tree_cpu: dict[int, tuple[int, dict[int, float]]] = field(default_factory=dict)
    """CPU seconds of every process of the run (the launched one and its descendants, pid to CPU-s),
    sampled when the lines of the steps :func:`run_timed` was asked to sample at arrived:
    ``{asked step: (step seen, CPU)}``."""

    @property
    def first_step_s(self) -> float:
        return self.step_at[min(self.step_at)]

    def steady_step_s(self, warmup: int) -> float:
        """Seconds per step after ``warmup`` steps: the least-squares slope of report time on step.

        A fit over every reported step, not (last - first) / n: a runner whose reports arrive in
        batches (``orch`` polls its workers every 0.5 s) is then not penalised or favoured by where
        the window's two ends happen to fall between polls.
        """
        points = sorted((s, t) for s, t in self.step_at.items() if s > warmup)
        if len(points) < 3:
            raise BenchError(f"{self.label}: only {len(points)} steps after the {warmup} warm-up steps; "
                             "raise --steps")
        return statistics.linear_regression([s for s, _ in points], [t for _, t in points]).slope

    def time_to_step(self, step: int) -> float:
        return self.step_at[step]

    def cpu_per_step_s(self, ranks: int) -> tuple[float, float]:
        """CPU seconds per step between the two sampled steps: of the ``ranks`` processes that used
        the most (the training ranks), per rank, and of every other process of the run together
        (its launcher or driver and, for ``orch``, Ray's servers). None sampled: NaNs."""
        if len(self.tree_cpu) < 2:
            return math.nan, math.nan
        (first_step, before), (last_step, after) = (self.tree_cpu[s] for s in sorted(self.tree_cpu)[:2])
        used = sorted((cpu - before.get(pid, 0.0) for pid, cpu in after.items()), reverse=True)
        steps = last_step - first_step
        return sum(used[:ranks]) / ranks / steps, sum(used[ranks:]) / steps


def run_timed(label: str, cmd: list[str], *, cwd: Path, env: dict[str, str] | None = None,
              timeout_s: float = 900, cpu_at_steps: tuple[int, ...] = ()) -> TimedRun:
    """Run ``cmd`` with stdout and stderr merged, timestamping every ``step N/T`` line; when the
    first line of a step at or past each of ``cpu_at_steps`` arrives, the CPU time of every process
    of the run is sampled (:attr:`TimedRun.tree_cpu`)."""
    run = TimedRun(label)
    cpu_at_launch = machine_cpu_s()
    started_wall, started = time.time(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    # A hung run must not hang the benchmark: kill its process group (its own session) at the deadline.
    watchdog = threading.Timer(timeout_s, lambda: proc.poll() is None and os.killpg(proc.pid, 9))
    watchdog.start()
    try:
        for line in proc.stdout:
            arrived = time.perf_counter() - started
            run.output.append(line.rstrip("\n"))
            match = STEP_LINE.search(line)
            if match:
                step = int(match.group(1))
                stamped = float(match.group(3)) - started_wall if match.group(3) else arrived
                if not run.step_at and cpu_at_launch is not None:
                    run.cpu_to_first_step_s = machine_cpu_s() - cpu_at_launch
                run.step_at.setdefault(step, stamped)
                for asked in cpu_at_steps:
                    if step >= asked and asked not in run.tree_cpu:
                        run.tree_cpu[asked] = (step, tree_cpu_s(proc.pid))
        proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:  # Ctrl-C: take the whole process group down with us
            os.killpg(proc.pid, 9)
            proc.wait()
    run.wall_s = time.perf_counter() - started
    if run.wall_s >= timeout_s:
        raise BenchError(f"{label}: killed after {timeout_s:.0f} s: {shlex.join(cmd)}")
    if proc.returncode != 0 or not run.step_at:
        tail = "\n".join(run.output[-80:])
        raise BenchError(f"{label} failed (exit code {proc.returncode}): {shlex.join(cmd)}\n{tail}")
    return run


def tree_cpu_s(root: int) -> dict[int, float]:
    """CPU seconds (user and system) that ``root`` and each live process descended from it have
    used, by pid: a launcher's ranks, or ``orch``'s driver with the Ray servers it started and the
    workers its raylet started. A process that exits meanwhile is left out."""
    import psutil

    try:
        top = psutil.Process(root)
        tree = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    used = {}
    for process in tree:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        used[process.pid] = times.user + times.system
    return used


def machine_cpu_s() -> float | None:
    """CPU seconds all processes on this machine have used since boot (Linux's ``/proc/stat``:
    every state but idle and I/O wait), or None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def interleaved(commands: dict[str, list[str]], repeats: int, *, cwd: Path, env: dict[str, str],
                retries: int = 1, cpu_at_steps: tuple[int, ...] = ()) -> tuple[dict[str, list[TimedRun]], list[str]]:
    """Run each command ``repeats`` times, alternating between them (a, b, a, b, ...).

    On a shared machine load comes in bursts; alternating puts a burst on both sides instead of
    on one. A launch that fails is retried up to ``retries`` times and its failure returned, so
    the results can say how many launches failed instead of hiding them.
    """
    runs: dict[str, list[TimedRun]] = {label: [] for label in commands}
    failures: list[str] = []
    for i in range(repeats):
        for label, cmd in commands.items():
            print(f"repetition {i + 1}/{repeats}: {label}", file=sys.stderr, flush=True)
            for attempt in range(retries + 1):
                try:
                    runs[label].append(run_timed(label, cmd, cwd=cwd, env=env, cpu_at_steps=cpu_at_steps))
                    break
                except BenchError as error:
                    failures.append(str(error).splitlines()[0])
                    print(f"{error}", file=sys.stderr, flush=True)
                    if attempt == retries:
                        raise
    return runs, failures


def failure_note(failures: list[str]) -> str:
    if not failures:
        return "- Every launch succeeded on its first attempt."
    return f"- {len(failures)} launch(es) failed and were retried: " + "; ".join(failures)


def orch_command(*overrides: str) -> list[str]:
    return [PYTHON, "-m", "orch", "train", *overrides]


def gpt_overrides(zero_stage: int, steps: int) -> list[str]:
    """The run the overhead benchmarks time on both sides: the built-in GPT, dp=2, every step logged."""
    return ["model=gpt", "plan.dp=2", f"plan.zero_stage={zero_stage}", f"train.steps={steps}", "train.log_every=1"]


def bench_env(**extra: str) -> dict[str, str]:
    """This environment with the repo importable and DeepSpeed on its CPU accelerator."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "bench"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", **extra})
    return env


def tune_json(command: list[str], what: str) -> dict:
    """The ``--json`` answer of an ``orch tune`` command, run as a user would (a fresh process in an
    empty directory, which the tuned plan file is written to and removed with); raises with the
    command's last output when it fails."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(command, cwd=cwd, env=bench_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"orch tune {what} exited {done.returncode}:\n{(done.stdout + done.stderr)[-2000:]}")
    return json.loads(done.stdout)


def median_spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """``median (min-max)``: the spread is shown, not hidden, on a shared and noisy machine."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def verdict(ratios: list[float], target: float) -> str:
    """Whether ``ratios`` (one per repetition) meet ``ratio <= target``, without overstating it.

    On a loaded machine one repetition can land far from the others; a median under the target
    with repetitions above it is reported as such, not as a plain "met".
    """
    over = sum(r > target for r in ratios)
    if statistics.median(ratios) > target:
        return f"<= {target}: **missed** ({over} of {len(ratios)} repetitions over)"
    if over:
        return f"<= {target}: met by the median; {over} of {len(ratios)} repetitions over"
    return f"<= {target}: met"


def machine() -> str:
    """The machine and software versions, for the results header."""
    import deepspeed
    import ray
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, "
            f"Ray {ray.__version__}")


# The machine's load when the benchmark started: with the load at the end, the header says how
# quiet the machine was while it ran (other jobs on a shared 2-core machine widen every spread).
_LOAD_AT_START = os.getloadavg()


def format_load(values: tuple[float, float, float]) -> str:
    """A load average as the results files print it, 1/5/15 minutes."""
    return "/".join(f"{v:.2f}" for v in values)


def header(title: str, argv: list[str]) -> list[str]:
    """Title, date, machine, its load while the benchmark ran and the command that reproduces the file."""
    script, *args = argv
    # Run as ``python -m bench.<name>``, argv[0] is the module's file.
    module = os.path.relpath(script, REPO).removesuffix(".py").replace(os.sep, ".") if script.endswith(".py") \
        else script
    command = shlex.join(["python", "-m", module, *args])
    return [f"# {title}", "",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- machine: {machine()}",
            f"- load average (1/5/15 min): {format_load(_LOAD_AT_START)} before the runs, "
            f"{format_load(os.getloadavg())} after",
            f"- reproduce: `{command}`", ""]


def publish(lines: list[str], markdown: Path | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    if markdown:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(text)


def compose_config(*overrides: str):
    """The run config `orch` would compose from ``overrides`` (Hydra's compose API, the shipped conf/)."""
    from hydra import compose, initialize_config_module

    from orch.config import register_configs

    register_configs()
    with initialize_config_module("orch.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def bench_parser(doc: str, *, steps: int, repeats: int, warmup: int | None = 20, zero_stage: bool = False,
                 runs_of: str = "side", first: dict[str, dict] | None = None,
                 extra: dict[str, dict] | None = None) -> argparse.ArgumentParser:
    """The options the side-by-side benchmarks share, with each script's defaults; described by the
    first line of the script's docstring ``doc``.

    ``--steps``, ``--warmup`` (None: the script has none), ``--repeats`` (help text: runs of each
    ``runs_of``), ``--zero-stage`` where asked, and ``--markdown`` last. A script's own options,
    flag to ``add_argument`` keywords, go ``first`` (before ``--steps``) or as ``extra`` (before
    ``--markdown``): ``--help`` lists the options in the order they are added.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flag, spec in (first or {}).items():
        parser.add_argument(flag, **spec)
    parser.add_argument("--steps", type=int, default=steps)
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup, help="steps left out of the steady state")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"runs of each {runs_of}, interleaved")
    if zero_stage:
        parser.add_argument("--zero-stage", type=int, default=1)
    for flag, spec in (extra or {}).items():
        parser.add_argument(flag, **spec)
    parser.add_argument("--markdown", type=Path)
    return parser


SHARED_MACHINE_NOTE = ("- The machine is a 2-core VM that other jobs can share (the load averages above say how busy "
                       "it was), so compare the spreads, not only the medians.")
"""The note under every table measured on the shared 2-core machine."""


def cpu_time_note() -> str:
    """The note under a table with a "CPU time until the first step" row: how to read it on this machine."""
    return (f"- CPU time counts every process on the machine ({os.cpu_count()} cores) from launch to the first "
            "step's line: divided by the cores, it is the least time that work could take.")


DS_CONFIG_NOTE = ("- The DeepSpeed config is generated once by `build_ds_config` and checked equal to the "
                  "`config/deepspeed.json` the `orch` run logged.")
"""The note under a table whose plain side runs the DeepSpeed config of :func:`bench.run_spec.plain_job`."""


def ratio_row(name: str, a: list[float], b: list[float], fmt: str, ratio_fmt: str = "{:.3f}",
              target: str | None = "") -> str:
    """A table row comparing two sides: ``a`` and ``b`` (a value per repetition, in the same order)
    as median (min-max) in ``fmt``, the per-repetition ratios b / a as median (min-max) in
    ``ratio_fmt``, then ``target`` in a column of its own (None: the table has no target column)."""
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    row = f"| {name} | {median_spread(a, fmt)} | {median_spread(b, fmt)} | {median_spread(ratios, ratio_fmt)} |"
    return row if target is None else f"{row} {target} |"


def publish_results(title: str, intro: str, table: list[str], notes: list[str], failures: list[str],
                    markdown: Path | None) -> None:
    """Print, and write to ``markdown`` where given, a benchmark's results: the :func:`header`, the
    ``intro`` paragraph, the ``table`` (its column and separator lines included), and the ``notes``
    closed by how many launches failed (:func:`failure_note`)."""
    publish([*header(title, sys.argv), intro, "", *table, "", "Notes:", *notes, failure_note(failures)], markdown)
