"""Submit overhead: `orch submit --wait` against `orch train` with ``cluster.address``, on one cluster.

A real Ray head is started on loopback with its dashboard (the Jobs server) and token
authentication. The same run goes to it both ways, alternately: ``orch train
cluster.address=HOST:PORT`` drives it from this process; ``orch submit --wait
cluster.address=http://HOST:DASHBOARD`` checks the plan here, ships an (empty) working
directory and runs ``orch train`` as a Ray Job on the head, while this process follows its log.
Both sides are timed from the outside, from launch, by when each ``step N/T`` line appears
(:mod:`bench.harness`): for the submitted job, as its log reaches the follower.

Targets: the submitted job's first step at most 10 s later than the direct run's, and the same
steady-state step time (within 3%).

    python -m bench.submit_overhead [--steps 200] [--repeats 3] [--markdown bench/results/submit_overhead.md]
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from bench.harness import (
    PYTHON,
    bench_env,
    bench_parser,
    interleaved,
    median_spread,
    orch_command,
    publish_results,
    verdict,
)

STEP_TARGET = 1.03
FIRST_STEP_EXTRA_S = 10.0
SIDES = ("orch train (driver here)", "orch submit --wait (Ray Job)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(temp_dir: Path, env: dict[str, str]) -> tuple[str, str]:
    """A Ray head with its Jobs server on loopback; returns its GCS and dashboard addresses."""
    ray = shutil.which("ray", path=os.path.dirname(PYTHON)) or "ray"
    port, dashboard = _free_port(), _free_port()
    subprocess.run([ray, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                    "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                    f"--temp-dir={temp_dir}", "--num-cpus=2", "--object-store-memory=300000000",
                    "--disable-usage-stats"], env={**env, "RAY_AUTH_MODE": "token"}, check=True,
                   capture_output=True, timeout=180)
    return f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}"


def stop_head(temp_dir: Path) -> None:
    """Stop exactly the processes of this head (`ray stop` would stop every Ray on the machine)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if str(temp_dir).encode() in f.read():
                    os.kill(int(entry), 9)
        except OSError:
            continue


def main() -> None:
    args = bench_parser(__doc__, steps=200, repeats=3).parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-submit-"))
    temp_dir = Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))  # short: Ray's socket paths have a length limit
    project = work / "project"  # the working directory the job ships: nothing of the user's here
    project.mkdir()
    token = temp_dir / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = bench_env(RAY_AUTH_TOKEN_PATH=str(token),
                    PATH=f"{os.path.dirname(PYTHON)}{os.pathsep}{os.environ.get('PATH', '')}")
    overrides = ["model=gpt", "plan.dp=2", "plan.zero_stage=1", f"train.steps={args.steps}", "train.log_every=1",
                 f"tracking.uri=sqlite:///{work / 'mlflow.db'}", f"train.checkpoint_dir={work / 'ckpt'}"]
    try:
        gcs, jobs = start_head(temp_dir, env)
        commands = {SIDES[0]: orch_command(*overrides, f"cluster.address={gcs}"),
                    SIDES[1]: [PYTHON, "-m", "orch", "submit", "--wait", *overrides,
                               f"cluster.address={jobs}"]}
        runs, failures = interleaved(commands, args.repeats, cwd=project, env=env)
    finally:
        stop_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)

    direct, submitted = runs[SIDES[0]], runs[SIDES[1]]
    steady_direct = [r.steady_step_s(args.warmup) for r in direct]
    steady_submitted = [r.steady_step_s(args.warmup) for r in submitted]
    ratios = [b / a for a, b in zip(steady_direct, steady_submitted, strict=True)]
    extra = [b.first_step_s - a.first_step_s for a, b in zip(direct, submitted, strict=True)]
    first_verdict = (f"<= {FIRST_STEP_EXTRA_S:g} s: met" if max(extra) <= FIRST_STEP_EXTRA_S else
                     f"<= {FIRST_STEP_EXTRA_S:g} s: **missed** ({sum(e > FIRST_STEP_EXTRA_S for e in extra)} of "
                     f"{len(extra)} repetitions over)")

    intro = (f"Built-in GPT (`model=gpt`), dp=2 on 2 CPU workers of one Ray head (loopback, token auth), ZeRO "
             f"stage 1, fp32, {args.steps} steps, every step printed; steady state = steps after {args.warmup}. "
             f"{args.repeats} repetitions of each side, interleaved; medians with (min-max).")
    # The ratio and the difference columns say which they are, so the rows are written out.
    table = ["| | orch train, driver here | orch submit --wait | submitted vs direct | target |",
             "|---|---:|---:|---:|---|",
             f"| steady-state step time (s) | {median_spread(steady_direct, '{:.4f}')} | "
             f"{median_spread(steady_submitted, '{:.4f}')} | {median_spread(ratios)} (ratio) | "
             f"{verdict(ratios, STEP_TARGET)} |",
             f"| time to first step (s) | {median_spread([r.first_step_s for r in direct], '{:.1f}')} | "
             f"{median_spread([r.first_step_s for r in submitted], '{:.1f}')} | "
             f"{median_spread(extra, '{:+.1f}')} s (difference) | {first_verdict} |",
             f"| launch to exit (s) | {median_spread([r.wall_s for r in direct], '{:.1f}')} | "
             f"{median_spread([r.wall_s for r in submitted], '{:.1f}')} | | |"]
    notes = ["- The submitted side includes the plan check here against the live nodes, shipping the working "
             "directory, the job's own Python and `orch` start-up on the head, and the delay of Ray's job-log "
             "stream to the follower; its step lines arrive in batches, which the steady-state slope averages out.",
             "- The head and both drivers share this 2-core machine (the load averages above say how busy it was)."]
    publish_results("Submit overhead: orch submit --wait vs orch train with cluster.address, same cluster", intro,
                    table, notes, failures, args.markdown)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
