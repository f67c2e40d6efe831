"""Tracking overhead: `orch train` tracked on a real `mlflow server` against the same run untracked.

A real `mlflow server` (sqlite backend, local artifact store) is started on loopback for the
benchmark, and `orch train` runs alternately with ``tracking.uri=http://127.0.0.1:PORT`` and with
``tracking.enabled=false``: same model, plan, data and steps, metrics logged every step (the
heaviest setting: one batch of ~10 metrics per step goes to the server). Repetitions are
interleaved on this shared machine. Afterwards every tracked run is read back from the server
to check that it holds a metric for every step, so the tracked side really did the work.

The target is on the steady-state step time (the slope of when each step's line appears after
launch, after the warm-up steps): tracking must not slow training by more than 2%. Time to
first step and launch to exit are shown too: tracking adds its start (params, config
artifacts) and its end (waiting for the buffered metrics, plots).

    python -m bench.tracking_overhead [--steps 300] [--repeats 4] [--system-metrics]
                                      [--markdown bench/results/tracking_overhead.md]

``--system-metrics`` compares instead two tracked runs: system metrics sampled every second
(ten times the default rate) against none (`bench/results/system_metrics_overhead.md`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.harness import (
    PYTHON,
    SHARED_MACHINE_NOTE,
    bench_env,
    bench_parser,
    gpt_overrides,
    interleaved,
    orch_command,
    publish_results,
    ratio_row,
    verdict,
)

TARGET = 1.02


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_mlflow_server(root: Path, port: int, *, app_name: str | None = None,
                         env: dict[str, str] | None = None) -> subprocess.Popen:
    """``mlflow server`` on loopback with a sqlite backend in ``root``, in a session of its own.

    Its job runner is off: nothing here submits server-side jobs, and with it on every server
    start leaves a directory in /dev/shm that MLflow never removes. ``app_name="basic-auth"``
    serves it behind MLflow's HTTP basic authentication (configured through ``env``).
    """
    mlflow = shutil.which("mlflow", path=os.path.dirname(PYTHON)) or "mlflow"
    app = ["--app-name", app_name] if app_name else []
    return subprocess.Popen([mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1", *app,
                             "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
                             "--artifacts-destination", str(root / "artifacts")],
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    """Return once the server at ``url`` answers /health; raise if it exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start on {url}") from None
            time.sleep(0.2)  # a refused connection answers at once: polling often costs nothing


def start_mlflow_server(root: Path) -> tuple[subprocess.Popen, str]:
    """A healthy ``mlflow server`` on a free loopback port; returns it and its URL."""
    port = _free_port()
    proc = launch_mlflow_server(root, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
    except RuntimeError:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def metric_steps_on_server(url: str, experiment: str) -> list[int]:
    """For every run of ``experiment``, how many steps have a ``loss`` metric on the server."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return [len(client.get_metric_history(r.info.run_id, "loss")) for r in runs]


def system_samples_on_server(url: str, experiment: str) -> list[int]:
    """For every run of ``experiment``, how many CPU samples its first node logged."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return [len(client.get_metric_history(r.info.run_id, "system/node0/cpu_utilization_percentage")) for r in runs]


TRACKING_SIDES = ("tracking off", "mlflow server")
SYSTEM_SIDES = ("system metrics off", "system metrics every 1 s")


def main() -> None:
    system_metrics = {"action": "store_true",
                      "help": "compare system metrics sampled every second against none, both tracked on the server"}
    args = bench_parser(__doc__, steps=300, repeats=4, zero_stage=True,
                        extra={"--system-metrics": system_metrics}).parse_args()

    overrides = gpt_overrides(args.zero_stage, args.steps)
    work = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    server, url = start_mlflow_server(work)
    try:
        tracked = [f"tracking.uri={url}", "tracking.experiment=tracking-overhead"]
        if args.system_metrics:
            sides = SYSTEM_SIDES
            commands = {sides[0]: orch_command(*overrides, *tracked, "tracking.system_metrics_interval_s=0"),
                        sides[1]: orch_command(*overrides, *tracked, "tracking.system_metrics_interval_s=1")}
        else:
            sides = TRACKING_SIDES
            commands = {sides[0]: orch_command(*overrides, "tracking.enabled=false"),
                        sides[1]: orch_command(*overrides, *tracked)}
        runs, failures = interleaved(commands, args.repeats, cwd=work, env=bench_env())
        logged = metric_steps_on_server(url, "tracking-overhead")
        samples = system_samples_on_server(url, "tracking-overhead")
    finally:
        stop(server)
    tracked_runs = args.repeats * (2 if args.system_metrics else 1)
    if len(logged) != tracked_runs or any(n != args.steps for n in logged):
        raise RuntimeError(f"expected {tracked_runs} tracked runs with {args.steps} logged steps each, "
                           f"the server holds {logged}")
    sampled = sorted(n for n in samples if n)
    if args.system_metrics and len(sampled) != args.repeats:
        raise RuntimeError(f"expected {args.repeats} runs with system metrics, the server holds {samples}")

    off, on = runs[sides[0]], runs[sides[1]]
    steady_off = [r.steady_step_s(args.warmup) for r in off]
    steady_on = [r.steady_step_s(args.warmup) for r in on]
    ratios = [b / a for a, b in zip(steady_off, steady_on, strict=True)]

    if args.system_metrics:
        title = "System-metrics overhead: orch train on a real mlflow server, sampled every second vs not"
        columns = "| | system_metrics_interval_s=0 | system_metrics_interval_s=1 | on / off | target |"
        what = (f"both sides tracked on the server; the first worker of the node samples CPU, memory, disk and "
                f"network every second with MLflow's monitors ({min(sampled)}-{max(sampled)} samples per run, "
                "each logged as system/node0/*)")
    else:
        title = "Tracking overhead: orch train on a real mlflow server vs tracking off"
        columns = "| | tracking.enabled=false | mlflow server (sqlite backend) | tracked / off | target |"
        what = "tracked: ~10 metrics per step sent to the server"
    intro = (f"Built-in GPT (`model=gpt`), dp=2 on 2 CPU workers, ZeRO stage {args.zero_stage}, fp32, "
             f"{args.steps} steps, every step logged ({what}); steady "
             f"state = steps after {args.warmup}. {args.repeats} repetitions of each side, interleaved; medians "
             "with (min-max). The ratio column is the median of the per-repetition ratios (min-max).")
    table = [columns,
             "|---|---:|---:|---:|---|",
             ratio_row("steady-state step time, wall clock (s)", steady_off, steady_on, "{:.4f}",
                       target=verdict(ratios, TARGET)),
             ratio_row("time to first step (s)", [r.first_step_s for r in off], [r.first_step_s for r in on], "{:.1f}"),
             ratio_row("launch to exit (s)", [r.wall_s for r in off], [r.wall_s for r in on], "{:.1f}")]
    notes = [f"{SHARED_MACHINE_NOTE} The `mlflow server` itself runs on the same 2 cores.",
             f"- Every tracked run was read back from the server: {args.steps} logged steps each.",
             "- Metrics are sent once a second by a driver thread at the lowest CPU priority (`SCHED_IDLE`), off "
             "the training path; the time to first "
             "step includes creating the run and logging params and config artifacts, launch to exit includes "
             "flushing the metrics and rendering and uploading the plots."]
    publish_results(title, intro, table, notes, failures, args.markdown)
    shutil.rmtree(work, ignore_errors=True)  # a failed run never gets here: its files stay for a look


if __name__ == "__main__":
    main()
