"""A user's own model, objective and Dataset, written in a directory outside this package and
declared in their own config directory, trained through the real `orch` command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers.processes import worker_env
from helpers.user_code import PAIRS_DATASET

pytestmark = pytest.mark.slow

USER_CODE = '''
import torch
import torch.nn.functional as F


class Net(torch.nn.Module):
    """A regression model of the user's, returning a dict as some libraries do. A dict batch is
    passed as keyword arguments, targets included, as Hugging Face models take their labels."""

    def __init__(self, features: int, hidden: int):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                        torch.nn.Linear(hidden, 1))

    def forward(self, x, y=None):
        return {"logits": self.body(x).squeeze(-1)}


def mse(outputs, batch):
    return F.mse_loss(outputs["logits"], batch["y"])

''' + PAIRS_DATASET


def test_a_users_own_model_objective_and_dataset_train_from_their_config_dir(tmp_path):
    """A dict batch reaches the model as keyword arguments (``model(**batch)``), the loss is the
    user's function, the Dataset is declared by its ``_target_`` like the model, and nothing is
    installed: the modules are found in the working directory. It trains under FSDP2 (a model with
    no repeated blocks: the root is sharded whole); tests/test_user_project.py trains the README's
    own-workload example under DeepSpeed."""
    work = tmp_path / "project"
    (work / "conf" / "model").mkdir(parents=True)
    (work / "conf" / "objective").mkdir()
    (work / "conf" / "data").mkdir()
    (work / "mine.py").write_text(USER_CODE)
    (work / "conf" / "model" / "mine.yaml").write_text("_target_: mine.Net\nfeatures: 8\nhidden: 32\n")
    (work / "conf" / "objective" / "mine.yaml").write_text("_target_: mine.mse\n")
    # The data declared as the model and the objective are, by _target_ alone: the Dataset's own
    # arguments beside it, no schema named (README's form, with data.collate, is tested verbatim
    # in tests/test_user_project.py). Dict samples are batched by torch's default collate.
    (work / "conf" / "data" / "mine.yaml").write_text("_target_: mine.Pairs\nsamples: 512\nfeatures: 8\n")
    # The installed `orch` script, run where the user's code is: nothing of theirs is installed.
    command = [str(Path(sys.executable).with_name("orch")), "train", "--config-dir", "conf", "model=mine",
               "objective=mine", "data=mine", "plan.engine=fsdp2", "train.steps=30", "train.log_every=10",
               "cluster.object_store_memory_gib=0.3", f"tracking.uri=sqlite:///{work / 'mlflow.db'}"]
    done = subprocess.run(command, cwd=work, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in done.stderr.splitlines() + done.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < 0.85 * losses[0], losses
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("orch").experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["plan.engine"] == "fsdp2" and run.data.params["objective._target_"] == "mine.mse"


def test_a_plan_too_big_for_a_model_without_checkpointing_gets_fixes_it_can_take():
    """The fix search leaves activation checkpointing out for a model with nothing to checkpoint."""
    from helpers.config import compose_config
    from orch.checking import check_run
    from orch.config import to_typed

    typed, model_cfg, _ = to_typed(compose_config("model=mlp", "data=dataset", "objective=classification",
                                                  "plan.micro_batch_size=512", "cluster.device_memory_gib=0.0001"))
    estimate, facts = check_run(typed, model_cfg)
    assert not facts.supports_activation_checkpointing and not estimate.feasible
    assert not [s for s in estimate.suggestions if "checkpointing" in s]
