"""The config schemas of the shipped models and data sources, registered in Hydra's ConfigStore.

Kept apart from the sources and models themselves, which import torch: composing a config needs
only these, so the command line imports torch only when a command uses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class CorpusDataConfig:
    """``data=corpus``: a text file read as bytes (a vocabulary of 256)."""

    _target_: str = "orch.workloads.corpus.CorpusSource"
    path: str | None = None
    """A text file (optionally .gz); null uses the corpus shipped with the project."""
    seq_len: int = 128
    """Tokens (bytes) per sample; the shipped configs tie it to model.seq_len."""
    val_fraction: float = 0.05
    """Tail of the corpus held out for evaluation."""


@dataclass(kw_only=True)
class DatasetDataConfig:
    """``data=dataset``: a map-style torch Dataset of the user's."""

    _target_: str = "orch.workloads.dataset.DatasetSource"
    dataset: dict[str, Any] = field(default_factory=dict)
    """The training Dataset: {_target_: mypkg.MyDataset, ...its arguments}."""
    val_dataset: dict[str, Any] | None = None
    """A held-out Dataset declared the same way; null: the last val_fraction of dataset."""
    val_fraction: float = 0.1
    """Share of dataset held out for evaluation when val_dataset is null."""
    collate: dict[str, Any] | None = None
    """A function turning a list of samples into a batch: {_target_: mypkg.collate, ...bound arguments};
    null: torch's default collation."""
    tokens_per_sample: int | None = None
    """Tokens in one sample, to report tokens/s; null: samples/s only."""
    required_outputs: int | None = None
    """The smallest output size the model needs (classes, vocabulary); null: not checked."""


@dataclass(kw_only=True)
class HFCausalLMConfig:
    """``model=hf_causal_lm``: a transformers causal LM from a config or a local directory."""

    _target_: str = "orch.workloads.hf.hf_causal_lm"
    config: dict[str, Any] | None = field(default_factory=dict)
    """A transformers config as a dict: its model_type (llama, gpt2, mistral, ...) and its sizes."""
    pretrained_path: str | None = None
    """A local directory written by save_pretrained (weights and config); replaces model.config."""
    config_path: str | None = None
    """A Hugging Face config.json (or its directory), no weights: the model it describes, keys it leaves
    out at their model type's defaults; replaces model.config."""


@dataclass(kw_only=True)
class ImagesDataConfig:
    """``data=images``: an image folder, or the bundled digits."""

    _target_: str = "orch.workloads.images.ImageSource"
    path: str | None = None
    """A directory with one subdirectory of images per class; null: scikit-learn's 8x8 digits (1,797 images)."""
    image_size: int = 32
    """Images are resized to image_size x image_size."""
    channels: int = 3
    """Channels the model takes (grayscale images are repeated to fill them)."""
    val_fraction: float = 0.1
    """Share of the images held out for evaluation (every 1/val_fraction-th image)."""
    num_classes: int | None = None
    """Classes the model predicts; null: as many as the folder has."""


@dataclass(kw_only=True)
class TextDataConfig:
    """``data=text``: text files tokenized and packed into windows."""

    _target_: str = "orch.workloads.text.TextSource"
    files: list[str] | None = None
    """Local .txt, .jsonl/.json or .parquet files or globs; null: the corpus shipped with the project."""
    text_field: str = "text"
    """The column holding the text in .jsonl and .parquet files (.txt files are read line by line)."""
    tokenizer: str | None = None
    """A local directory written by a Hugging Face tokenizer's save_pretrained; null: UTF-8 bytes (256 tokens)."""
    seq_len: int = 128
    """Tokens per sample; the shipped configs tie it to model.seq_len where the model has one."""
    val_fraction: float = 0.05
    """Share of the windows held out for evaluation (the last ones)."""
    cache_dir: str = "~/.cache/orch/text"
    """Where tokenized windows are kept, one directory per (files, tokenizer, seq_len)."""


@dataclass(kw_only=True)
class TorchvisionModelConfig:
    """``model=torchvision``: a ``torchvision.models`` builder and its arguments."""

    _target_: str = "orch.workloads.vision.torchvision_model"
    name: str = "resnet18"
    """A builder of torchvision.models: resnet18, resnet50, vit_b_16, convnext_tiny, ..."""
    num_classes: int = 10
    """Classes the classifier predicts."""
    weights_path: str | None = None
    """A local state dict (.pt or .safetensors) to start from; null: random initialization."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Further builder arguments, e.g. {image_size: 32} for a ViT."""


SELF_CONTAINED_SOURCES = frozenset(config._target_ for config in (
    CorpusDataConfig(), DatasetDataConfig(), ImagesDataConfig(), TextDataConfig()))
"""The shipped data sources that run no Ray tasks of their own: a run reading one needs no CPUs
besides its workers', which is known before the source is built."""


def from_schema(schema: type, name: str) -> Any:
    """A dataclass field of a source class that takes its default from the schema's field of that
    name: the schema is what users read, so each default is stated there and nowhere else."""
    declared = {f.name: f for f in dataclasses.fields(schema)}
    if name not in declared:
        raise TypeError(f"{schema.__name__} has no field {name!r}: a source's defaulted fields must be "
                        f"named as in its schema ({', '.join(sorted(declared))})")
    if declared[name].default_factory is not dataclasses.MISSING:
        return field(default_factory=declared[name].default_factory)
    return field(default=declared[name].default)
