"""The published Hugging Face configs shipped with the model presets (``model=llama3_8b``, ...).

Kept apart from :mod:`orch.workloads.hf`, which imports torch: a preset's path is resolved while the
config is composed (``${orch_hf_config:NAME}`` in orch/conf/model/), before any model is
built.
"""

from __future__ import annotations

from pathlib import Path

PRESETS_DIR = Path(__file__).with_name("hf_configs")
"""The ``config.json`` files, one per preset, as their authors published them (weights left out)."""


def preset_config_path(name: str) -> str:
    """The path of the shipped ``config.json`` called ``name``."""
    path = PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))
        raise ValueError(f"no shipped Hugging Face config named {name!r}; the shipped ones are: {known}")
    return str(path)
