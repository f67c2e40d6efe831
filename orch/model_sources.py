"""Which of a Hugging Face model's sources the user meant, when the command line names one.

``model=hf_causal_lm`` builds its model from exactly one of ``model.config`` (a dict),
``model.config_path`` (a ``config.json``) or ``model.pretrained_path`` (a ``save_pretrained``
directory). The group ships one of them filled in: ``hf_causal_lm`` a small example ``config``,
the presets (``model=llama3_8b``, ...) a ``config_path`` to a published file. A user who names
another source on the command line means that source, so the shipped one is dropped, with a
note saying so. Two sources the user set (both on the command line, or in a config file of
their own) are still refused when the model is built: which one was meant is not for orch to
guess.

Kept free of torch and transformers: it runs while the config is read, before any command's
work starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

HF_TARGET = "orch.workloads.hf.hf_causal_lm"
SOURCES = ("config", "config_path", "pretrained_path")
EXAMPLE_FILE = Path(__file__).with_name("conf") / "model" / "hf_causal_lm.yaml"
"""The group option whose ``config`` is the shipped example."""


def command_line_overrides() -> list[str] | None:
    """The overrides of the running Hydra command; None outside one (a config composed in code)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return list(HydraConfig.get().overrides.task)


def prefer_command_line_source(cfg: DictConfig, overrides: list[str] | None = None) -> list[str]:
    """Drop (set to null) the sources of ``cfg.model`` that its group ships when the command line
    names another one; the notes saying what was dropped, printed to stderr too.

    ``overrides`` defaults to the running command's (:func:`command_line_overrides`); without
    any, nothing changes.
    """
    overrides = command_line_overrides() if overrides is None else overrides
    model = cfg.get("model")
    if not overrides or not isinstance(model, DictConfig) or model.get("_target_") != HF_TARGET:
        return []
    named, touched = _command_line_sources(overrides)
    if not named:
        return []
    given = " and ".join(f"model.{source}" for source in SOURCES if source in named)
    notes = []
    for source in SOURCES:
        if source in touched or not _shipped(source, model.get(source)):
            continue
        model[source] = None
        notes.append(f"note: {given} given on the command line replaces the model.{source} that {_option()} "
                     f"ships: model.{source} is set to null")
    for note in notes:
        print(note, file=sys.stderr)
    return notes


def _option() -> str:
    """``model=NAME``, the group option the command chose (``the model group`` outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    choice = HydraConfig.get().runtime.choices.get("model") if HydraConfig.initialized() else None
    return f"model={choice}" if choice else "the model group"


def _command_line_sources(overrides: list[str]) -> tuple[set[str], set[str]]:
    """The sources the overrides set to a value, and every source they touch at all
    (``model.config.hidden_size=64`` and ``~model.config`` touch ``model.config``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    named, touched = set(), set()
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        for source in SOURCES:
            if key == f"model.{source}" or key.startswith(f"model.{source}."):
                touched.add(source)
                if key == f"model.{source}" and not override.is_delete() and override.value() is not None:
                    named.add(source)
    return named, touched


def _shipped(source: str, value: object) -> bool:
    """Whether ``value`` of ``model.<source>`` is the one a shipped group option sets: the
    example's config, or a published config.json of a preset."""
    if value is None:
        return False
    if source == "config":
        example = OmegaConf.load(EXAMPLE_FILE).get("config")
        return isinstance(value, DictConfig) and OmegaConf.to_container(value) == OmegaConf.to_container(example)
    if source == "config_path":
        from orch.workloads.hf_presets import PRESETS_DIR

        return Path(str(value)).parent.resolve() == PRESETS_DIR.resolve()
    return False
