"""A user's project as the README and Hydra's tutorials lay it out (their modules and a `conf/`
directory of their own), run by the installed `orch` command as the user runs it: from that
directory, with nothing of this repository on PYTHONPATH."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers.config import REPO
from helpers.projects import plant_packages_named_like_orchs_parts
from helpers.user_code import PAIRS_DATASET

ORCH = Path(sys.executable).with_name("orch")

# The README's example names these and nothing else: a model of `features` inputs, a loss, a
# map-style Dataset of dict samples (the README gives it `samples` only) and a collate function.
MINE_PY = '''
import torch
import torch.nn.functional as F


class Net(torch.nn.Module):
    def __init__(self, features: int, hidden: int):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                        torch.nn.Linear(hidden, 1))

    def forward(self, x, y=None):
        return self.body(x).squeeze(-1)


def mse(outputs, batch):
    return F.mse_loss(outputs, batch["y"])

''' + PAIRS_DATASET


def user_env() -> dict[str, str]:
    """The user's environment: the installed package only (a PYTHONPATH naming this repository
    would put its packages on the path as a plain directory, which a user's install does not)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def orch(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(ORCH), *args], cwd=cwd, env=user_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def installed_from_this_checkout(tmp_path_factory):
    """These tests mean this checkout's code: the installed `orch` must import it."""
    done = subprocess.run([sys.executable, "-c", "import orch; print(orch.__file__)"],
                          cwd=tmp_path_factory.mktemp("empty"), env=user_env(), capture_output=True, text=True)
    assert Path(done.stdout.strip()).resolve().is_relative_to(REPO.resolve()), (
        f"the installed orch imports {done.stdout.strip() or done.stderr[-500:]}, not {REPO}: "
        "run `pip install -e .` in this checkout")


def readme_own_workload() -> tuple[dict[str, str], list[str]]:
    """The README's "Your own workload" example: its YAML files (three columns of one block, each
    headed by its path) and its commands."""
    section = (REPO / "README.md").read_text().split("## Your own workload", 1)[1]
    yaml_block = section.split("```yaml\n", 1)[1].split("```", 1)[0].splitlines()
    header, rows = yaml_block[0], yaml_block[1:]
    columns = [(m.start(), m.group(1)) for m in re.finditer(r"# (\S+)", header)]
    files = {}
    for i, (start, path) in enumerate(columns):
        end = columns[i + 1][0] if i + 1 < len(columns) else None
        lines = [row[start:end].rstrip() for row in rows]
        files[path] = "".join(line + "\n" for line in lines if line)
    bash_block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in bash_block.splitlines() if line.startswith("orch ")]
    return files, commands


def user_project(root: Path) -> tuple[Path, list[str]]:
    """The README's example laid out as a user would: ``mine.py`` and ``conf/`` side by side."""
    files, commands = readme_own_workload()
    assert sorted(files) == ["conf/data/mine.yaml", "conf/model/mine.yaml", "conf/objective/mine.yaml"], files
    assert len(commands) == 2 and commands[0].startswith("orch check ") and commands[1].startswith("orch train ")
    project = root / "project"
    for path, text in files.items():
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(text)
    (project / "mine.py").write_text(MINE_PY)
    return project, commands


def test_the_readme_own_workload_check_runs_verbatim_from_a_project_with_a_conf_directory(tmp_path):
    """The user's ``conf/`` is theirs: the shipped configs are not looked up by that name."""
    project, commands = user_project(tmp_path)
    done = orch(*shlex.split(commands[0])[1:], cwd=project)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "FITS" in done.stdout and "Primary config module" not in done.stderr


def test_commands_that_only_read_write_nothing_in_the_working_directory(tmp_path):
    """`orch check`, `config` and `runs` leave the user's directory as it was: no Hydra run
    directory (``outputs/<date>/<time>/``) per command. Asked for, Hydra's record is written.
    Python's own bytecode cache of the user's module (``__pycache__``, which any import of it
    writes where bytecode writing is on, as it is by default) is not orch's writing."""
    project, commands = user_project(tmp_path)

    def written() -> list[Path]:
        return sorted(p.relative_to(project) for p in project.rglob("*") if "__pycache__" not in p.parts)

    before = written()
    check = orch(*shlex.split(commands[0])[1:], cwd=project)
    assert check.returncode == 0, check.stderr[-2000:]
    config = orch("config", "--config-dir", "conf", "model=mine", cwd=project)
    assert config.returncode == 0 and "_target_: mine.Net" in config.stdout, config.stderr[-2000:]
    runs = orch("runs", cwd=project)  # no store here: refused, and still nothing written
    assert runs.returncode == 2 and "there is no MLflow store" in runs.stderr, runs.stderr[-2000:]
    assert written() == before
    recorded = orch(*shlex.split(commands[0])[1:], "hydra.run.dir=record", cwd=project)
    assert recorded.returncode == 0, recorded.stderr[-2000:]
    assert "mine.Net" in (project / "record" / ".hydra" / "config.yaml").read_text()


def test_folders_named_like_orchs_packages_do_not_replace_them(tmp_path):
    """A project may hold folders and packages named as generically as orch's parts (configs,
    notes, its own ``plans`` package)."""
    project, commands = user_project(tmp_path)
    plant_packages_named_like_orchs_parts(project)
    for name in ("plans", "workloads", "launchers", "orchestrator"):
        (project / name / "notes.yaml").write_text("mine: true\n")
    done = orch(*shlex.split(commands[0])[1:], cwd=project)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "FITS" in done.stdout


def test_a_tuned_plan_may_be_written_into_the_users_own_conf_directory(tmp_path):
    """The user's ``conf/`` is not orch's package, even for an install whose metadata still names a
    top-level `conf` (one made before the configs moved into orch/)."""
    project, _ = user_project(tmp_path)
    done = orch("tune", "train.global_batch_size=16", "tune.pp=[1]", "tune.out=conf/plan/tuned.yaml", cwd=project)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (project / "conf" / "plan" / "tuned.yaml").is_file()


def test_flags_may_come_anywhere_among_the_overrides(tmp_path):
    """`orch check plan.zero_stage=2 --config-dir mine model=mine`: argparse, under Hydra, took no
    flag after an override ("unrecognized arguments: model=mine")."""
    (tmp_path / "mine" / "model").mkdir(parents=True)
    (tmp_path / "mine" / "model" / "mine.yaml").write_text("defaults: [gpt_schema, _self_]\nn_layer: 1\n")
    done = orch("check", "plan.zero_stage=2", "--config-dir", "mine", "model=mine", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["plan"]["zero_stage"] == 2
    composed = orch("config", "plan.zero_stage=2", "--config-dir", "mine", "model=mine", "-cd", "mine",
                    "--verbose", cwd=tmp_path)
    assert composed.returncode == 0, composed.stderr[-2000:]
    assert "n_layer: 1" in composed.stdout and "zero_stage: 2" in composed.stdout
    # A flag's value is not a run id: the run id is the first argument that is neither.
    run_id = "0123456789abcdef0123456789abcdef"
    report = orch("report", "--config-dir", "mine", run_id, f"tracking.uri=sqlite:///{tmp_path / 'm.db'}",
                  cwd=tmp_path)
    assert report.returncode == 2 and "config directory" not in report.stderr, report.stderr
    assert "there is no MLflow store" in report.stderr, report.stderr


def test_help_lists_the_options_a_user_can_choose_and_no_schema(tmp_path):
    """The schemas are registered in the config groups (the YAML files extend them), but selecting
    one is never what a user wants: `--help` listed `corpus_schema`, `gpt_schema`, ... as options."""
    for group in ("model", "data"):
        (tmp_path / "configs" / group).mkdir(parents=True)
    (tmp_path / "configs" / "model" / "mine.yaml").write_text("defaults: [gpt_schema, _self_]\nn_layer: 1\n")
    (tmp_path / "configs" / "data" / "mine.yaml").write_text("defaults: [corpus_schema, _self_]\nseq_len: 64\n")
    done = orch("check", "--help", "--config-dir", "configs", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "_schema" not in done.stdout, done.stdout
    groups = dict(line.split(": ", 1) for line in done.stdout.splitlines() if re.fullmatch(r"[a-z_]+: [\w, -]+", line))
    assert groups["data"] == "corpus, dataset, images, mine, ray, text"  # the user's options among the shipped ones
    assert groups["model"].split(", ")[:3] == ["gpt", "gpt3_175b", "hf_causal_lm"] and "mine" in groups["model"]
    assert groups["plan"] == "ddp, fsdp2, pipeline, zero3_offload" and "hydra" not in groups


@pytest.mark.slow
def test_the_readme_own_workload_trains_verbatim(tmp_path):
    """From a project that also holds its own packages named like orch's parts."""
    project, commands = user_project(tmp_path)
    plant_packages_named_like_orchs_parts(project)
    done = orch(*shlex.split(commands[1])[1:], cwd=project, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("orch").experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["plan.zero_stage"] == "2" and run.data.params["model._target_"] == "mine.Net"
