"""Labelled images: ``data=images``, a folder with one subdirectory per class, or scikit-learn's
bundled digits when no folder is given (they ship inside the package, so examples run offline).

Samples are ``(image[C, S, S] float32, label)`` pairs, resized to ``image_size`` and normalized.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from orch.plans.errors import Violation
from orch.workloads.schemas import ImagesDataConfig, from_schema

_FIX = "point data.path at a directory with one subdirectory of images per class, or set data.path=null for the " \
       "bundled digits"
_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
DIGITS_CLASSES = 10


def _split(n: int, val_fraction: float) -> tuple[list[int], list[int]]:
    """Deterministic held-out split: evenly spread indices go to evaluation, so every class is in both."""
    n_val = int(n * val_fraction)
    val = {round(i * n / n_val) for i in range(n_val)} if n_val else set()
    return [i for i in range(n) if i not in val], sorted(val)


class _Digits(torch.utils.data.Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor, indices: list[int], image_size: int,
                 channels: int):
        self.images, self.labels, self.indices = images, labels, indices
        self.image_size, self.channels = image_size, channels

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.indices[i]
        image = self.images[index][None, None]  # [1, 1, 8, 8], values 0..16
        image = torch.nn.functional.interpolate(image, size=(self.image_size, self.image_size), mode="bilinear",
                                                align_corners=False)[0]
        image = (image / 16.0 - 0.5) / 0.5
        return image.expand(self.channels, -1, -1).contiguous(), self.labels[index]


class _Folder(torch.utils.data.Dataset):
    def __init__(self, folder, indices: list[int]):
        self.folder, self.indices = folder, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.folder[self.indices[i]]
        return image, torch.tensor(label)


@dataclass(frozen=True, kw_only=True)
class ImageSource:
    """Labelled images as a :class:`orch.plans.model.workload.DataSource`."""

    path: str | None = from_schema(ImagesDataConfig, "path")
    image_size: int = from_schema(ImagesDataConfig, "image_size")
    channels: int = from_schema(ImagesDataConfig, "channels")
    val_fraction: float = from_schema(ImagesDataConfig, "val_fraction")
    num_classes: int | None = from_schema(ImagesDataConfig, "num_classes")

    tokens_per_sample = None

    @cached_property
    def _classes(self) -> list[str]:
        if self.path is None:
            return [str(d) for d in range(DIGITS_CLASSES)]
        return sorted(d.name for d in Path(self.path).iterdir() if d.is_dir() and not d.name.startswith("."))

    @property
    def required_outputs(self) -> int:
        return len(self._classes)

    def _files(self) -> dict[str, list[Path]]:
        root = Path(self.path)
        return {c: sorted(p for p in (root / c).rglob("*") if p.suffix.lower() in _SUFFIXES) for c in self._classes}

    def violations(self, samples_per_step: int = 1) -> list[Violation]:
        found = []
        if self.image_size < 1:
            found.append(Violation("data.image_size", self.image_size, "must be at least 1.",
                                   "set data.image_size=32, or the size the model takes"))
        if self.channels not in (1, 3):
            found.append(Violation("data.channels", self.channels, "must be 1 or 3.", "set data.channels=3"))
        if found or self.path is None:
            return found + self._size_violations(samples_per_step, None)
        root = Path(self.path)
        if not root.is_dir():
            return [Violation("data.path", self.path, "no such directory." if not root.exists() else
                              "is not a directory.", _FIX)]
        if not self._classes:
            return [Violation("data.path", self.path, "has no class subdirectories.", _FIX)]
        files = self._files()
        empty = [c for c, paths in files.items() if not paths]
        if empty:
            return [Violation("data.path", self.path, f"class folder(s) {', '.join(empty[:5])} hold no images "
                              f"({', '.join(sorted(_SUFFIXES))}).", "add images there or remove the folder")]
        if self.num_classes is not None and self.num_classes < len(files):
            found.append(Violation("data.num_classes", self.num_classes,
                                   f"{self.path} has {len(files)} classes: labels would reach {len(files) - 1}.",
                                   f"set data.num_classes={len(files)} (and the model's class count)"))
        found += self._unreadable(files)
        return found + self._size_violations(samples_per_step, sum(len(p) for p in files.values()))

    @staticmethod
    def _unreadable(files: dict[str, list[Path]]) -> list[Violation]:
        """Every image is opened and verified (headers and structure, without decoding pixels)."""
        from PIL import Image

        for paths in files.values():
            for path in paths:
                try:
                    with Image.open(path) as image:
                        image.verify()
                except Exception as error:  # noqa: BLE001 - PIL raises many types for a bad file
                    return [Violation("data.path", str(path), f"is not a readable image: {error}.",
                                      "remove or replace the file")]
        return []

    def _size_violations(self, samples_per_step: int, total: int | None) -> list[Violation]:
        if not 0 < self.val_fraction < 1:
            return []  # reported by the range checks
        n_train, n_val = self._sizes(total)
        if min(n_train, n_val) >= samples_per_step:
            return []
        return [Violation("data.val_fraction" if n_train >= samples_per_step else "data.path",
                          self.val_fraction if n_train >= samples_per_step else self.path,
                          f"{n_train + n_val} images split by data.val_fraction={self.val_fraction:g} give {n_train} "
                          f"training and {n_val} evaluation images; each part needs {samples_per_step}.",
                          "use more images, or change data.val_fraction")]

    def _sizes(self, total: int | None) -> tuple[int, int]:
        if total is None:
            total = 1797 if self.path is None else sum(len(p) for p in self._files().values())
        train, val = _split(total, self.val_fraction)
        return len(train), len(val)

    def sizes(self) -> tuple[int, int]:
        return self._sizes(None)

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(batch_size, self.channels, self.image_size, self.image_size, device="meta"),
                torch.zeros(batch_size, dtype=torch.long, device="meta"))

    def prepare(self) -> None:
        """Nothing to build: images are decoded as they are read."""

    def datasets(self) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
        if self.path is None:
            from sklearn.datasets import load_digits

            digits = load_digits()
            images = torch.tensor(digits.images, dtype=torch.float32)
            labels = torch.tensor(digits.target, dtype=torch.long)
            train, val = _split(len(images), self.val_fraction)
            return (_Digits(images, labels, train, self.image_size, self.channels),
                    _Digits(images, labels, val, self.image_size, self.channels))
        from torchvision import datasets, transforms

        mode = "RGB" if self.channels == 3 else "L"
        transform = transforms.Compose([
            transforms.Lambda(lambda image: image.convert(mode)),
            transforms.Resize(self.image_size), transforms.CenterCrop(self.image_size), transforms.ToTensor(),
            transforms.Normalize([0.5] * self.channels, [0.5] * self.channels)])
        folder = datasets.ImageFolder(self.path, transform=transform)
        train, val = _split(len(folder), self.val_fraction)
        return _Folder(folder, train), _Folder(folder, val)

    def collate(self) -> Callable[[list], Any] | None:
        return None

    def describe(self) -> dict[str, Any]:
        if self.path is None:
            from sklearn.datasets import load_digits

            digits = load_digits()
            digest = hashlib.sha256(digits.images.tobytes() + digits.target.tobytes()).hexdigest()
            return {"name": "digits", "source": "sklearn.datasets.load_digits", "size": len(digits.target),
                    "unit": "images", "digest": digest, "classes": DIGITS_CLASSES, "image_size": self.image_size}
        digest = hashlib.sha256()
        count = 0
        for label, paths in self._files().items():
            for path in paths:
                digest.update(f"{label}/{path.name}".encode())
                digest.update(path.read_bytes())
                count += 1
        return {"name": Path(self.path).name, "source": str(Path(self.path).resolve()), "size": count,
                "unit": "images", "digest": digest.hexdigest(), "classes": len(self._classes),
                "image_size": self.image_size}
