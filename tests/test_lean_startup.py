"""Start-up shortcuts (orch/launchers/lean_startup.py) and the memory probe's view of frozen objects."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from orch.launchers.lean_startup import collector_paused
from orch.launchers.memory_probe import TensorsMade, live_tensor_bytes

FP32 = 4


@pytest.fixture
def unfrozen():
    """Leave the collector as the test found it: enabled, nothing frozen."""
    yield
    gc.unfreeze()
    gc.enable()


def test_the_collector_is_off_inside_and_the_survivors_frozen_after(unfrozen):
    class Survivor:
        pass

    with collector_paused():
        assert not gc.isenabled()
        survivor = Survivor()
    assert gc.isenabled()
    assert gc.get_freeze_count() > 0
    assert not any(obj is survivor for obj in gc.get_objects())  # frozen: no pass scans it again


def test_a_pause_inside_a_pause_or_with_the_collector_off_changes_nothing(unfrozen):
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()  # the inner one did not turn it back on
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_live_bytes_count_frozen_tensors_and_leave_them_frozen(unfrozen):
    gc.collect()
    before = live_tensor_bytes()
    kept = torch.zeros(1000)
    gc.freeze()
    assert live_tensor_bytes() - before == 1000 * FP32
    assert not any(obj is kept for obj in gc.get_objects())
    del kept


def test_tensors_made_in_a_block_are_counted_and_older_ones_are_not(unfrozen):
    older = torch.zeros(5000)
    with TensorsMade() as made:
        data = [torch.zeros(300), torch.zeros(100)]
        view_of_new = data[0][:10]
        dropped = torch.zeros(10**6)
        del dropped
    assert made.bytes == 400 * FP32
    del older, data, view_of_new


def test_deepspeed_is_imported_without_mlflow_which_stays_importable():
    """In a fresh interpreter, as in a worker: MLflow is not imported, and importing it afterwards
    works (DeepSpeed only lost its autotuner's logging)."""
    code = ("import sys\n"
            "from orch.launchers.engines.deepspeed.building import import_deepspeed\n"
            "deepspeed = import_deepspeed()\n"
            "assert 'mlflow' not in sys.modules, 'mlflow was imported'\n"
            "import deepspeed.autotuning.autotuner as autotuner\n"
            "assert autotuner.has_mlflow is False\n"
            "import mlflow\n"
            "print(mlflow.__version__)\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
