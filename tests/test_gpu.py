"""Real-GPU tests of what needs several GPUs: skipped with fewer than 2. Run them on any GPU machine
with `bench/gpu_smoke.sh` (or `python -m pytest -m gpu tests/test_gpu.py`); what does not fit the
machine's GPU count is skipped with the reason. One GPU is checked by bench/gpu_check.py instead,
with ~1B-parameter models.

They train the built-in GPT with real DeepSpeed in Ray actors, one GPU each, and check that every
rank got its own device and talks to the others over NCCL, that the loss falls, and that the
planner's predicted peak is within its target of the peak CUDA's allocator measured.
"""

from __future__ import annotations

import os

import pytest
import ray
import torch

from helpers.config import compose_config
from helpers.ray_cluster import release_shared_ray
from orch.config import to_typed
from orch.run.driver import run_training

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(GPUS < 2, reason=f"needs 2 or more GPUs, this machine has {GPUS} "
                                                  "(one GPU: bench/gpu_check.py)")]

MODEL = ["model.n_layer=4", "model.d_model=256", "model.n_head=8", "model.seq_len=128"]
PEAK_TARGET = 0.10


@pytest.fixture(scope="module")
def gpu_ray():
    """An embedded Ray with every GPU of the machine and a CPU for each worker."""
    from orch.launchers.ray_session import start_local_ray

    release_shared_ray()  # a Ray of its own: other resources

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    start_local_ray(num_cpus=max(os.cpu_count() or 1, GPUS), num_gpus=GPUS, object_store_memory=2 * 1024**3,
                    runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([repo, os.path.join(repo, "tests")])}})
    yield
    ray.shutdown()


def needs(gpus: int):
    return pytest.mark.skipif(GPUS < gpus, reason=f"needs {gpus} GPUs, this machine has {GPUS}")


def train_on_gpus(sqlite_uri: str, gpus: int, *overrides: str):
    memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    cfg = compose_config(f"tracking.uri={sqlite_uri}", "cluster.accelerator=gpu", f"cluster.devices_per_node={gpus}",
                         f"cluster.device_memory_gib={memory_gib:.2f}", "train.steps=20", "train.log_every=10",
                         *MODEL, *overrides)
    return run_training(*to_typed(cfg))


def check_result(result, gpus: int) -> None:
    losses = [reports[0].loss for reports in result.reports]
    assert losses[-1] < losses[0], losses
    assert len(result.worker_facts) == gpus
    last = result.reports[-1]
    measured = max(r.measured_peak_bytes for r in last)
    # CUDA's allocator counts allocated bytes; the planner's reserve is the cache it keeps beyond them.
    predicted = max(stage.total - stage.reserve for stage in result.estimate.stages)
    assert abs(predicted - measured) / measured <= PEAK_TARGET, (predicted, measured)


@pytest.mark.parametrize("plan", [["plan.zero_stage=0"], ["plan.zero_stage=2", "plan.precision=bf16"]],
                         ids=["ddp", "zero2-bf16"])
def test_data_parallel_on_every_gpu(gpu_ray, sqlite_uri, plan):
    check_result(train_on_gpus(sqlite_uri, GPUS, *plan), GPUS)


@needs(2)
def test_tensor_parallel(gpu_ray, sqlite_uri):
    check_result(train_on_gpus(sqlite_uri, 2, "plan.dp=1", "plan.tp=2"), 2)


@needs(2)
def test_pipeline_parallel(gpu_ray, sqlite_uri):
    check_result(train_on_gpus(sqlite_uri, 2, "plan.dp=1", "plan.pp=2", "plan.grad_accum_steps=4"), 2)


def test_zero3_with_cpu_offload(gpu_ray, sqlite_uri):
    check_result(train_on_gpus(sqlite_uri, GPUS, "plan.zero_stage=3", "plan.offload_optimizer=cpu",
                               "plan.offload_param=cpu", "plan.precision=bf16"), GPUS)
