"""torchvision's classifiers by name: ``model=torchvision model.name=resnet50``.

Built with ``weights=None`` always (no download at run time); ``weights_path`` loads a local
state dict instead, read weights-only.
"""

from __future__ import annotations

from typing import Any

import torch


def torchvision_model(name: str, num_classes: int, weights_path: str | None = None,
                      kwargs: dict[str, Any] | None = None) -> torch.nn.Module:
    from torchvision import models

    builders = models.list_models(module=models)
    if name not in builders:
        raise ValueError(f"model.name={name!r} is not a torchvision.models classifier; known: {', '.join(builders)}")
    module = models.get_model(name, weights=None, num_classes=num_classes, **(kwargs or {}))
    if weights_path:
        if weights_path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(weights_path)
        else:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
        module.load_state_dict(state)
    return module
