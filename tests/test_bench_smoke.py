"""The side-by-side benchmarks' moving parts: step-line timing (pure) and the plain DeepSpeed
baseline under a real `torchrun` at its smallest size. The benchmarks themselves are not run in
CI (minutes each, and their numbers mean little on a loaded CI machine)."""

from __future__ import annotations

import math
import os
import sys

import pytest

from bench.harness import STEP_LINE, BenchError, TimedRun, bench_env, run_timed
from bench.overhead_vs_deepspeed import plain_in_loop_step_s
from bench.run_spec import plain_job, write_job
from helpers.config import REPO


def test_step_lines_of_every_runner_are_recognised():
    orch = STEP_LINE.search("step 12/150  loss 3.1000  tokens/s 9,000")
    plain = STEP_LINE.search("step 3/20 loss 5.5 lr 1e-05 step_time 0.071 t=1763780000.250000")
    ray = STEP_LINE.search("\x1b[36m(RayTrainWorker pid=1)\x1b[0m step 4/20 loss 5.4 step_time 0.07 t=1763780001.5")
    assert (orch.group(1), orch.group(3)) == ("12", None)
    assert (plain.group(1), plain.group(3)) == ("3", "1763780000.250000")
    assert (ray.group(1), ray.group(3)) == ("4", "1763780001.5")
    assert STEP_LINE.search("rank 1 at 3/20 step_time 0.07") is None  # other ranks' lines are not rank 0's
    assert STEP_LINE.search("done: 20 steps in 30.0s") is None


def test_steady_step_time_is_the_slope_after_warmup_and_ignores_polling_batches():
    run = TimedRun("polled")
    # 0.1 s per step after a slow start, reports arriving in batches of 3 as a 0.3 s poll would deliver them.
    for step in range(1, 61):
        run.step_at[step] = 10.0 + 0.3 * math.ceil(step / 3) if step > 5 else 2.0 * step
    assert run.first_step_s == 2.0
    assert run.steady_step_s(warmup=5) == pytest.approx(0.1, rel=0.02)
    with pytest.raises(BenchError, match="raise --steps"):
        run.steady_step_s(warmup=59)


@pytest.mark.slow
def test_plain_deepspeed_baseline_trains_under_torchrun(tmp_path):
    """The baseline of bench/overhead_vs_deepspeed.py, 5 steps: every step reported by rank 0, in order."""
    steps = 5
    job = plain_job(["model=gpt", "plan.dp=2", "plan.zero_stage=1", f"train.steps={steps}", "train.log_every=1",
                     "train.eval_batches=1", "plan.micro_batch_size=2"])
    assert job["ds_config"]["zero_optimization"]["stage"] == 1 and job["dp"] == 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "bench" / "plain_deepspeed.py"), "--job", str(write_job(job, tmp_path / "job.json"))]
    run = run_timed("torchrun", cmd, cwd=tmp_path, env=bench_env(), timeout_s=300, cpu_at_steps=(2, steps))
    assert sorted(run.step_at) == list(range(1, steps + 1))
    times = [run.step_at[s] for s in range(1, steps + 1)]
    assert times == sorted(times) and 0 < run.first_step_s < run.wall_s
    # Two ranks importing torch and DeepSpeed use more than a CPU-second; no machine has more cores
    # busy than it has.
    assert 1.0 < run.cpu_to_first_step_s < run.first_step_s * os.cpu_count() + 1
    assert run.steady_step_s(warmup=1) > 0
    assert plain_in_loop_step_s(run, warmup=1) > 0
    assert any("eval_loss" in line for line in run.output)
    # The ranks' CPU per step between steps 2 and 5 is found among the launcher's descendants
    # (torchrun starts each rank in a session of its own); the launcher's is what is left.
    per_rank, rest = run.cpu_per_step_s(ranks=2)
    assert per_rank > 0 and 0 <= rest < per_rank
    assert any("threads per rank: 1" in line for line in run.output)  # torchrun's OMP_NUM_THREADS=1


def test_the_benchmark_readmes_tables_are_the_results_files():
    from bench.readme_tables import MARKED, render

    readme = (REPO / "bench" / "README.md").read_text()
    assert len(MARKED.findall(readme)) >= 4
    assert render(readme) == readme, "run python bench/readme_tables.py after a benchmark wrote its results"
