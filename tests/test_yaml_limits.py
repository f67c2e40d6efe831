"""A user's config files are bounded before Hydra composes them (orch/yaml_limits.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.orch_command import orch_run
from orch.yaml_limits import ConfigFileRefusedError, check_yaml_file, config_dirs

# Nine levels of nine aliases: ten lines that stand for 387 million strings.
LEVELS = zip("abcdefgh", "bcdefghi", strict=True)
BOMB = "_target_: orch.workloads.gpt.GPT\na: &a [" + ",".join(['"lol"'] * 9) + "]\n" + "".join(
    f"{level}: &{level} [{','.join([f'*{previous}'] * 9)}]\n" for previous, level in LEVELS)


def test_anchors_a_config_may_use_pass_and_what_expands_past_the_limit_does_not(tmp_path):
    fine = tmp_path / "fine.yaml"
    fine.write_text("base: &base {lr: 0.1, betas: [0.9, 0.95]}\nadam: *base\nsgd: {<<: *base, momentum: 0.9}\n")
    check_yaml_file(fine)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    with pytest.raises(ConfigFileRefusedError, match=rf"config file {bomb}: its aliases \(\*name\) expand to more"):
        check_yaml_file(bomb)
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigFileRefusedError, match="nests deeper than a config can"):
        check_yaml_file(deep)
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\n")
    check_yaml_file(broken)  # not YAML: Hydra's own message names the problem


def test_the_directories_hydra_would_search_are_found_on_the_command_line():
    assert config_dirs(["--config-dir", "conf", "-cd", "mine", "--config-dir=other"],
                       ["model=x", "hydra.searchpath=[file:///shared/conf,pkg://x]"]) == [
        Path("conf"), Path("mine"), Path("other"), Path("/shared/conf")]


@pytest.mark.parametrize("command", ["config", "check"])
def test_an_alias_bomb_in_a_config_dir_is_refused_at_once_naming_the_file(tmp_path, command):
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "bomb.yaml").write_text(BOMB)
    done = orch_run([command, "--config-dir", "conf", "model=bomb"], cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "config file conf/model/bomb.yaml: its aliases (*name) expand to more than 1,000,000 values" in done.stderr
