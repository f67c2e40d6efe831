"""The ways a user declares their data in a config file of their own, through the installed `orch
check` run in their project directory: by ``_target_`` alone as a model is declared, by a
``dataset:`` key without naming our schema, and what is refused (with one message each)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers.orch_command import orch_run

USER_CODE = '''
import torch


class Points(torch.utils.data.Dataset):
    def __init__(self, samples=64, features=8):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, features, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def points(samples=64):
    return Points(samples=samples)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([])


class Net(torch.nn.Module):
    def __init__(self, features=8):
        super().__init__()
        self.body = torch.nn.Linear(features, 1)

    def forward(self, x):
        return self.body(x)


def mse(outputs, batch):
    return torch.nn.functional.mse_loss(outputs, batch[1])
'''


@pytest.fixture
def project(tmp_path):
    for group in ("model", "objective", "data"):
        (tmp_path / "conf" / group).mkdir(parents=True)
    (tmp_path / "mine.py").write_text(USER_CODE)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text("_target_: mine.Net\nfeatures: 8\n")
    (tmp_path / "conf" / "objective" / "mine.yaml").write_text("_target_: mine.mse\n")
    return tmp_path


def check(project: Path, data: str) -> subprocess.CompletedProcess:
    (project / "conf" / "data" / "mine.yaml").write_text(data)
    return orch_run(["check", "--config-dir", "conf", "model=mine", "objective=mine",
                     "data=mine"], cwd=project, timeout=300)


@pytest.mark.parametrize("data", ["_target_: mine.Points\nsamples: 64\n", "_target_: mine.points\n",
                                  "dataset: {_target_: mine.Points, samples: 64}\nval_fraction: 0.25\n"],
                         ids=["dataset-class", "dataset-function", "dataset-key-without-schema"])
def test_a_dataset_declared_the_hydra_way_is_the_data_source(project, data):
    done = check(project, data)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FITS" in done.stdout


def test_what_builds_no_dataset_is_refused_once_naming_what_was_built(project):
    done = check(project, "_target_: mine.Net\n")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "built a Net, which is neither a torch Dataset nor a data source" in done.stderr
    assert done.stderr.count("data._target_='mine.Net'") == 1


def test_an_iterable_dataset_is_refused_with_what_to_do(project):
    done = check(project, "_target_: mine.Stream\n")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "builds an IterableDataset (Stream)" in done.stderr and "data=ray" in done.stderr


def test_a_data_file_naming_nothing_is_refused_once(project):
    done = check(project, "samples: 64\n")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("data names no _target_") == 1
