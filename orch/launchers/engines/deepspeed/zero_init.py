"""Building a model under ZeRO-3: each rank allocates only its partition of every parameter.

``deepspeed.zero.Init`` partitions each parameter as soon as the module that owns it is built.
A library that initializes or loads weights after construction must know it is building under
ZeRO-3, or its values land in parameters already emptied: Hugging Face transformers initializes
its models' weights in ``post_init`` and loads ``from_pretrained`` weights after construction,
and without being told it does both into the empty partitions (the model keeps torch's default
initialization, or loses the pretrained weights). Told through its public ``HfDeepSpeedConfig``,
as Accelerate and the Trainer do, it gathers each module's partitions to initialize or load them.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator


@contextlib.contextmanager
def zero3_build(ds_config: dict) -> Iterator[None]:
    """``deepspeed.zero.Init`` with ``ds_config``, transformers told for the build's duration."""
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=ds_config), _transformers_told(ds_config):
        yield


@contextlib.contextmanager
def _transformers_told(ds_config: dict) -> Iterator[None]:
    if importlib.util.find_spec("transformers") is None:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    # transformers holds only a weak reference: the object must stay alive while models are built.
    told = HfDeepSpeedConfig(ds_config)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del told
