"""Any map-style torch ``Dataset`` of the user's: ``data=dataset``.

The dataset (and an optional collate function) are declared by Hydra ``_target_`` and
instantiated in each worker, not in the driver, so an expensive dataset is opened where it is
read. The driver builds it once only to check it and to take the planner's example batch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch
from hydra.utils import get_object, instantiate

from orch.plans.errors import Violation
from orch.plans.model.workload import move_batch
from orch.workloads.lineage import samples_digest
from orch.workloads.schemas import DatasetDataConfig

_DECLARED = DatasetDataConfig()
"""The schema's defaults, which DatasetSource's arguments take so each is stated once."""


def _cause(error: BaseException) -> BaseException:
    while error.__cause__ is not None:
        error = error.__cause__
    return error


class DatasetSource:
    """The user's Dataset as a :class:`orch.plans.model.workload.DataSource`."""

    def __init__(self, *, dataset: dict[str, Any], val_dataset: dict[str, Any] | None = _DECLARED.val_dataset,
                 val_fraction: float = _DECLARED.val_fraction, collate: dict[str, Any] | None = _DECLARED.collate,
                 tokens_per_sample: int | None = _DECLARED.tokens_per_sample,
                 required_outputs: int | None = _DECLARED.required_outputs):
        self.dataset, self.val_dataset, self.val_fraction = dataset, val_dataset, val_fraction
        self.collate_config = collate
        self.tokens_per_sample, self.required_outputs = tokens_per_sample, required_outputs

    def __getstate__(self) -> dict[str, Any]:
        """Pickled to the workers without the datasets the driver opened to check them."""
        return {k: v for k, v in self.__dict__.items() if k != "_checked"}

    def _collate_fn(self) -> Callable[[list], Any] | None:
        if not self.collate_config:
            return None
        config = self.collate_config
        if isinstance(config, str):
            return get_object(config)
        function = get_object(config["_target_"])
        arguments = {k: v for k, v in config.items() if not k.startswith("_")}
        return functools.partial(function, **arguments) if arguments else function

    def _open(self) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
        train = instantiate(self.dataset, _convert_="all")
        if self.val_dataset:
            return train, instantiate(self.val_dataset, _convert_="all")
        n_val = int(len(train) * self.val_fraction)
        indices = list(range(len(train)))
        return (torch.utils.data.Subset(train, indices[:len(train) - n_val]),
                torch.utils.data.Subset(train, indices[len(train) - n_val:]))

    @cached_property
    def _checked(self) -> tuple[tuple[torch.utils.data.Dataset, torch.utils.data.Dataset] | None, list[Violation]]:
        """The datasets opened once in the driver, or why they cannot be."""
        if not isinstance(self.dataset, dict) or "_target_" not in self.dataset:
            return None, [Violation("data.dataset", self.dataset, "names no _target_.",
                                    "set data.dataset._target_ to a Dataset class or factory")]
        try:
            opened = self._open()
        except Exception as error:  # noqa: BLE001 - the user's dataset may raise anything
            cause = _cause(error)
            return None, [Violation("data.dataset", self.dataset["_target_"],
                                    f"could not be built: {type(cause).__name__}: {str(cause)[:300]}.",
                                    "fix the dataset's arguments, or make its module importable")]
        if self.collate_config:
            try:
                self._collate_fn()
            except Exception as error:  # noqa: BLE001 - an import of the user's code
                return None, [Violation("data.collate", self.collate_config, f"cannot be imported: {_cause(error)}.",
                                        "set data.collate._target_ to the dotted path of a function")]
        return opened, []

    def violations(self, samples_per_step: int = 1) -> list[Violation]:
        opened, found = self._checked
        if found:
            return found
        train, val = opened
        if min(len(train), len(val)) < samples_per_step:
            return [Violation("data.dataset", self.dataset["_target_"],
                              f"{len(train)} training and {len(val)} evaluation samples; each part needs "
                              f"{samples_per_step}.", "use more samples, or change data.val_fraction")]
        try:
            self.example_batch(min(2, len(train)))
        except Exception as error:  # noqa: BLE001 - the user's samples or collate function
            return [Violation("data.collate" if self.collate_config else "data.dataset",
                              self.collate_config or self.dataset["_target_"],
                              f"its samples cannot be batched: {type(error).__name__}: {str(error)[:300]}.",
                              "return tensors of one shape per field, or give data.collate")]
        return []

    def sizes(self) -> tuple[int, int]:
        train, val = self._checked[0] or self._open()
        return len(train), len(val)

    def example_batch(self, batch_size: int) -> Any:
        train, _ = self._checked[0] or self._open()
        samples = [train[i % len(train)] for i in range(batch_size)]
        collate = self._collate_fn() or torch.utils.data.default_collate
        return move_batch(collate(samples), "meta")

    def prepare(self) -> None:
        """Nothing to build: the dataset is the user's."""

    def datasets(self) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
        return self._open()

    def collate(self) -> Callable[[list], Any] | None:
        return self._collate_fn()

    def describe(self) -> dict[str, Any]:
        train, val = self._checked[0] or self._open()
        arguments = json.dumps(self.dataset, sort_keys=True, default=str)
        return {"name": str(self.dataset.get("_target_")).rsplit(".", 1)[-1], "source": self.dataset.get("_target_"),
                "size": len(train) + len(val), "unit": "samples",
                "digest": samples_digest(_Joined(train, val), salt=arguments),
                "train_samples": len(train), "val_samples": len(val)}


class _Joined:
    """The train then the eval split, indexed as one sequence (for the digest)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __len__(self) -> int:
        return len(self.first) + len(self.second)

    def __getitem__(self, i: int):
        return self.first[i] if i < len(self.first) else self.second[i - len(self.first)]


class GaussianBlobs(torch.utils.data.Dataset):
    """A generated classification set: ``classes`` Gaussian clusters in ``features`` dimensions.

    The shipped example of ``data=dataset`` (with ``model=mlp objective=classification``); a
    user's own Dataset takes its place through ``data.dataset._target_``.
    """

    def __init__(self, samples: int = 1024, features: int = 16, classes: int = 4, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        centers = torch.randn(classes, features, generator=generator) * 3
        self.labels = torch.randint(classes, (samples,), generator=generator)
        self.points = centers[self.labels] + torch.randn(samples, features, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[i], self.labels[i]
