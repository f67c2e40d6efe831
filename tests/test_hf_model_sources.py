"""Where a Hugging Face model comes from (``model=hf_causal_lm``): a directory's own code is never
run nor asked about, cut-short safetensors are refused before any worker starts, and a source
named on the command line replaces the one the model group ships."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.config import compose_config
from helpers.orch_command import orch_run
from orch.checking import check_run
from orch.config import to_typed
from orch.model_sources import prefer_command_line_source
from orch.plans.errors import PlanError
from orch.workloads.hf_presets import preset_config_path

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}


def check(*overrides: str):
    typed, model_cfg, _ = to_typed(compose_config(*overrides))
    return check_run(typed, model_cfg)


def orch(tmp_path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return orch_run([*args], cwd=tmp_path, input=stdin, timeout=120)


def custom_code_directory(directory, marker) -> None:
    """A save_pretrained-like directory whose config names a model type transformers does not ship
    and maps it to Python beside it, which writes ``marker`` when it runs."""
    directory.mkdir()
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import PretrainedConfig\n" \
           "class MysteryConfig(PretrainedConfig):\n    model_type = 'mystery_lm'\n"
    (directory / "configuration_mystery.py").write_text(code)
    (directory / "modeling_mystery.py").write_text(code)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "mystery_lm", "hidden_size": 64,
        "auto_map": {"AutoConfig": "configuration_mystery.MysteryConfig",
                     "AutoModelForCausalLM": "modeling_mystery.MysteryForCausalLM"}}))
    save_file({"weight": torch.zeros(4)}, str(directory / "model.safetensors"))


def test_a_directory_with_its_own_code_is_refused_before_transformers_can_ask(tmp_path):
    """transformers asked on the terminal whether to run the directory's code (three times), and a
    `y` ran it: the directory is refused at once, and its code never runs, whatever stdin says."""
    marker = tmp_path / "MARKER"
    custom_code_directory(tmp_path / "mystery", marker)
    done = orch(tmp_path, "check", "model=hf_causal_lm", "model.config=null", "model.pretrained_path=mystery",
                stdin="y\ny\ny\n")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr
    assert not marker.exists()
    assert "model.pretrained_path='mystery': " in done.stderr
    assert "declares model_type 'mystery_lm', which transformers does not ship" in done.stderr
    assert '"auto_map": {"AutoConfig": "configuration_mystery.MysteryConfig"' in done.stderr
    assert "see docs/workloads.md" in done.stderr and "Traceback" not in done.stderr


def test_a_config_file_with_its_own_code_is_refused_naming_the_field(tmp_path):
    marker = tmp_path / "MARKER"
    custom_code_directory(tmp_path / "mystery", marker)
    with pytest.raises(PlanError) as info:
        check("model=hf_causal_lm", "model.config=null", f"model.config_path={tmp_path / 'mystery'}")
    assert info.value.violations[0].field == "model.config_path"
    assert "which transformers does not ship" in str(info.value) and not marker.exists()


def saved_tiny_llama(directory) -> None:
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA)).save_pretrained(directory)


def test_a_cut_short_safetensors_file_is_refused_naming_the_file(tmp_path):
    """The planner builds on meta from config.json alone: a weight file cut short by a copy passed
    the check and failed in every worker."""
    saved_tiny_llama(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    with pytest.raises(PlanError) as info:
        check("model=hf_causal_lm", "model.config=null", f"model.pretrained_path={tmp_path}")
    violation = info.value.violations[0]
    assert violation.field == "model.pretrained_path" and violation.value == str(tmp_path)
    assert f"{weights} ({len(data) // 2:,} bytes) is not a whole safetensors file" in violation.message
    assert "file not fully covered" in violation.message


def test_a_shard_the_index_lists_but_the_directory_lacks_is_refused(tmp_path):
    saved_tiny_llama(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(PlanError, match=r"lists shard\(s\) the directory lacks \(model-00002-of-00002.safetensors\)"):
        check("model=hf_causal_lm", "model.config=null", f"model.pretrained_path={tmp_path}")


def test_a_source_on_the_command_line_replaces_the_one_the_group_ships():
    overrides = ["model=hf_causal_lm", "model.config_path=llama.json"]
    cfg = compose_config(*overrides)
    notes = prefer_command_line_source(cfg, overrides)
    assert cfg.model.config is None and cfg.model.config_path == "llama.json"
    assert notes == ["note: model.config_path given on the command line replaces the model.config that the model "
                     "group ships: model.config is set to null"]
    # A preset's published config.json gives way to a save_pretrained directory.
    overrides = ["model=llama3_8b", "model.pretrained_path=weights"]
    cfg = compose_config(*overrides)
    prefer_command_line_source(cfg, overrides)
    assert cfg.model.config_path is None and cfg.model.pretrained_path == "weights"


@pytest.mark.parametrize("overrides", [
    ["model=hf_causal_lm", "model.config_path=llama.json", "model.config.hidden_size=64"],  # both on the command line
    ["model=hf_causal_lm", "model.config_path=llama.json", "model.config={model_type: llama}"],
])
def test_two_sources_the_user_set_are_left_to_the_models_refusal(overrides):
    cfg = compose_config(*overrides)
    assert prefer_command_line_source(cfg, overrides) == [] and cfg.model.config is not None


def test_a_config_of_the_users_own_is_not_taken_for_the_shipped_example():
    """A config the user's own file sets (here composed, not from the command line) is theirs."""
    cfg = compose_config("model=hf_causal_lm", "model.config.hidden_size=64", "model.config_path=llama.json")
    assert prefer_command_line_source(cfg, ["model.config_path=llama.json"]) == []
    assert cfg.model.config is not None
    cfg = compose_config("model=hf_causal_lm", f"model.config_path={preset_config_path('llama3_8b')}")
    assert prefer_command_line_source(cfg, []) == [] and cfg.model.config is not None


def test_orch_config_and_check_take_the_config_file_the_command_line_names(tmp_path):
    """`model=hf_causal_lm model.config_path=llama.json` was refused until model.config=null was added."""
    (tmp_path / "llama.json").write_text(json.dumps(TINY_LLAMA))
    shown = orch(tmp_path, "config", "model=hf_causal_lm", "model.config_path=llama.json")
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "  config: null\n" in shown.stdout and "  config_path: llama.json\n" in shown.stdout
    note = ("note: model.config_path given on the command line replaces the model.config that model=hf_causal_lm "
            "ships: model.config is set to null")
    assert note in shown.stderr
    checked = orch(tmp_path, "check", "--json", "model=hf_causal_lm", "model.config_path=llama.json")
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert note in checked.stderr
    # Llama's untied head: embeddings and head 2 x 256 x 64, 2 layers of 41,088, the final norm.
    assert json.loads(checked.stdout)["model"]["param_count"] == 2 * 256 * 64 + 2 * 41_088 + 64


def test_every_transformers_loader_in_the_project_is_told_not_to_run_remote_code():
    """A tokenizer or model directory may map its classes to its own Python (``auto_map``):
    transformers asks on the terminal whether to run it unless told ``trust_remote_code=False``."""
    import ast

    from helpers.config import REPO

    untold = []
    for package in ("orch", "bench"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("from_pretrained", "from_config")
                        and isinstance(node.func.value, ast.Name) and node.func.value.id.startswith("Auto")):
                    continue
                told = any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is False
                           for k in node.keywords)
                if not told:
                    untold.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert untold == []
