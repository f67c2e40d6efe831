"""Credentials given as overrides are refused before Hydra records the command line or anything
prints or ships it, judged by what the key names (docs/reliability.md, Credentials).

The name test (:func:`orch.launchers.passthrough.credential_word`) is the one every check uses: the
variables withheld from workers, `orch submit`'s ``submit.env`` and every command's overrides.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_cluster import env_without_mlflow_credentials, files_holding

from helpers.orch_command import orch_run
from helpers.processes import free_port
from orch.credentials import (
    CLUSTER_CREDENTIALS_FIX,
    CredentialsError,
    refuse_secret_overrides,
    secret_overrides,
)
from orch.launchers.passthrough import credential_word, withheld_from_workers
from orch.submit import shipped_credentials

SECRET = "Pw-not-to-be-seen-5678"
CONF = Path(__file__).resolve().parents[1] / "orch" / "conf"


@pytest.mark.parametrize(("name", "word"), [
    ("MLFLOW_TRACKING_PASSWORD", "PASSWORD"), ("DB_PASSWD", "PASSWD"), ("PGPASSWORD", "PASSWORD"),
    ("MYSQL_PWD", "PWD"), ("HF_AUTH", "AUTH"), ("auth", "AUTH"), ("HF_TOKEN", "TOKEN"), ("token", "TOKEN"),
    ("authToken", "TOKEN"), ("AWS_SECRET_ACCESS_KEY", "SECRET"), ("aws_secret_access_key", "SECRET"),
    ("AWS_ACCESS_KEY_ID", "ACCESS_KEY"), ("api_key", "API_KEY"), ("apiKey", "API_KEY"),
    ("OPENAI_APIKEY", "API_KEY"), ("PRIVATE_KEY_PEM", "PRIVATE_KEY"), ("AZURE_STORAGE_ACCOUNT_KEY", "KEY"),
    ("GOOGLE_APPLICATION_CREDENTIALS", "CREDENTIAL"), ("ssh_passphrase", "PASSPHRASE"),
    ("DB_PASS", "PASS"), ("SMTP_PASS", "PASS"), ("dbPass", "PASS"),
    # Not credentials: counts and names of a model's tokens, a dataset's keys, the shell's directory.
    ("max_tokens", None), ("tokenizer_name", None), ("tokenizer", None), ("tokens_per_sample", None),
    ("pad_token", None), ("eos_token", None), ("pad_token_id", None), ("num_key_value_heads", None),
    ("text_key", None), ("key", None), ("no_such_key", None), ("sort_key", None), ("signing_key", "KEY"),
    ("AUTHOR", None), ("author", None), ("RAY_AUTH_MODE", None),
    ("TOKENIZERS_PARALLELISM", None), ("PWD", None), ("OLDPWD", None), ("MLFLOW_TRACKING_USERNAME", None),
    ("PASS", None), ("backward_pass", None), ("eval_pass", None), ("PASS_COUNT", None), ("bypass", None),
])
def test_a_name_is_a_credential_by_its_words_not_its_letters(name, word):
    assert credential_word(name) == word


def test_every_route_into_an_override_is_judged_by_the_key_it_sets():
    overrides = ["+hydra.job.env_set.DB_PASSWD=x", "submit.env.HF_AUTH=x", "++foo.api_key=x", "~bar.token=x",
                 "+model.secret=a,b", f"hydra.job.env_set={{HF_TOKEN:{SECRET},NCCL_DEBUG:INFO}}",
                 "+submit.env={aws_secret_access_key: x}", "+x=[{client: {password: y}}]",
                 "+y=choice({token: 1},{a: 2})", "+broken.password=(unparsable",
                 # Not credentials, or no value given:
                 "model.tokenizer_name=gpt2", "+train.max_tokens=3", "~baz.password", "--config-dir=conf",
                 "tracking.uri=http://host:5000", "+hydra.job.env_set.MLFLOW_TRACKING_USERNAME=admin"]
    assert secret_overrides(overrides) == [
        ("hydra.job.env_set.DB_PASSWD", "PASSWD"), ("submit.env.HF_AUTH", "AUTH"), ("foo.api_key", "API_KEY"),
        ("bar.token", "TOKEN"), ("model.secret", "SECRET"), ("hydra.job.env_set.HF_TOKEN", "TOKEN"),
        ("submit.env.aws_secret_access_key", "SECRET"), ("x.client.password", "PASSWORD"), ("y.token", "TOKEN"),
        ("broken.password", "PASSWORD")]


def _keys(node, prefix=""):
    """Every dotted key of a config (a dict from OmegaConf.to_container)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{prefix}{key}"
            yield from _keys(value, f"{prefix}{key}.")


def test_no_key_of_the_shipped_configs_or_of_hydra_s_own_is_taken_for_a_credential():
    from hydra import compose, initialize_config_module

    from orch.config import register_configs

    register_configs()
    with initialize_config_module("orch.conf", version_base="1.3"):
        keys = list(_keys(OmegaConf.to_container(compose("config", return_hydra_config=True))))
    keys += [key for path in CONF.rglob("*.yaml") for key in _keys(OmegaConf.to_container(OmegaConf.load(path)))]
    assert len(keys) > 200
    assert [key for key in keys if credential_word(key.rpartition(".")[2])] == []


def test_the_refusal_names_each_key_and_where_its_credential_belongs_never_its_value():
    with pytest.raises(CredentialsError) as refused:
        refuse_secret_overrides([f"+hydra.job.env_set.HF_TOKEN={SECRET}", f"+model.api_key={SECRET}"], "train")
    assert SECRET not in str(refused.value)
    assert str(refused.value).splitlines()[1:] == [
        "  - hydra.job.env_set.HF_TOKEN (its name holds TOKEN). Fix: remove it and export HF_TOKEN in the shell "
        "that runs `orch train` (or set it from your secrets mechanism): the command reads its environment",
        "  - model.api_key (its name holds API_KEY). Fix: remove it and let the code read the credential from an "
        "environment variable exported in your shell; a setting that is no secret can be set in a config file "
        "(--config-dir)"]
    with pytest.raises(CredentialsError) as shipped:
        refuse_secret_overrides([f"+submit.env.HF_TOKEN={SECRET}"], "submit")
    assert str(shipped.value).endswith(f"submit.env.HF_TOKEN (its name holds TOKEN). Fix: remove it and "
                                       f"{CLUSTER_CREDENTIALS_FIX}")
    refuse_secret_overrides(["train.max_tokens=3", "model.tokenizer_name=gpt2"], "train")  # nothing refused


def test_a_submission_refuses_a_credential_set_through_the_jobs_environment_override():
    found = shipped_credentials([f"+hydra.job.env_set.MLFLOW_TRACKING_PASSWORD={SECRET}"], {})
    assert [(v.field, v.value) for v in found] == [("hydra.job.env_set.MLFLOW_TRACKING_PASSWORD", "(not shown)")]
    assert SECRET not in str(found[0])


@pytest.mark.parametrize(("name", "withheld"), [("DB_PASSWD", True), ("HF_AUTH", True), ("MYSQL_PWD", True),
                                                ("TOKENIZERS_PARALLELISM", False), ("AUTHOR", False)])
def test_the_workers_inherit_no_variable_named_like_a_credential(name, withheld):
    assert withheld_from_workers(name, object_store=False) is withheld


@pytest.mark.parametrize("arguments", [
    # As reported: the password would sit in the job's entrypoint, which `ray job list` shows.
    ["submit", "+hydra.job.env_set.MLFLOW_TRACKING_USERNAME=admin",
     f"+hydra.job.env_set.MLFLOW_TRACKING_PASSWORD={SECRET}"],
    ["submit", f"+submit.env.MY_API_TOKEN={SECRET}"],
    ["submit", f"++submit.env.aws_secret_access_key={SECRET}"],
    # Run here, Hydra would write it into outputs/<date>/<time>/.hydra/hydra.yaml.
    ["train", f"+hydra.job.env_set.MLFLOW_TRACKING_PASSWORD={SECRET}"],
    ["tune", f"++hydra.job.env_set={{DB_PASSWD:{SECRET}}}"],
])
def test_a_credential_override_is_refused_before_anything_is_written_printed_or_sent(arguments, tmp_path):
    command, override = arguments[0], arguments[-1]
    key = override.lstrip("+").partition("=")[0]
    key = "hydra.job.env_set.DB_PASSWD" if key == "hydra.job.env_set" else key
    nothing_listens = f"http://127.0.0.1:{free_port()}"  # refused before any connection is tried
    done = orch_run([*arguments, f"tracking.uri={nothing_listens}",
                     f"cluster.address={nothing_listens}" if command == "submit" else "train.steps=1"],
                    cwd=tmp_path, env=env_without_mlflow_credentials(), timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    fix = CLUSTER_CREDENTIALS_FIX if command == "submit" else f"export {key.rpartition('.')[2]} in the shell"
    assert f"  - {key} (its name holds " in done.stderr and fix in done.stderr, done.stderr[-3000:]
    assert SECRET not in done.stdout + done.stderr
    assert files_holding(SECRET, tmp_path) == [] and not (tmp_path / "outputs").exists()
