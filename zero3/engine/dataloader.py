"""The DataLoader `initialize(training_data=...)` returns, as DeepSpeed's does: each data-parallel rank
reads its own share of the dataset (a `DistributedSampler`), `train_micro_batch_size_per_gpu` items
at a time. Call `loader.sampler.set_epoch(epoch)` at each epoch for a new shuffle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset


def check_dataset(dataset: Any) -> None:
    """A sampler splits a dataset by index: it must have __getitem__ and __len__ (not an IterableDataset)."""
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(
            "training_data must be a map-style dataset (with __getitem__ and __len__, so that a sampler can split "
            f"it across ranks), got {type(dataset).__name__}"
        )


def training_loader(
    dataset: Any, micro_batch: int, rank: int, world_size: int, collate_fn: Callable[[list[Any]], Any] | None,
    drop_last: bool,
) -> DataLoader:
    check_dataset(dataset)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, drop_last=drop_last)
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last)
