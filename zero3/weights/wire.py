"""What crosses from the training side to a generator: names mapped to the generator's, and each weight bucket
as its bytes beside a JSON-able header (its dtype and size, and each delivered parameter's name, shape,
offset and element count), which a receiver reads back as `(name, tensor)` views. Nothing is pickled."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

NameMap = Mapping[str, str] | Callable[[str], str | None] | None
DEFAULT_BUCKET_BYTES = 256 << 20
_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                           torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


def mapped(name: str, name_map: NameMap) -> str | None:
    """`name` as the generator calls it (a dict, or a callable); None where the map leaves it out."""
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name, name)


def header(bucket: Any, name_map: NameMap) -> dict[str, Any]:
    """A `zero3.WeightBucket`'s header: its dtype and bytes, and a row per parameter the map delivers."""
    rows = [[name, list(entry.shape), entry.offset, entry.numel]
            for entry in bucket.entries if (name := mapped(entry.name, name_map)) is not None]
    return {"nbytes": bucket.nbytes, "dtype": str(bucket.flat.dtype), "entries": rows}


def raw_bytes(bucket: Any) -> torch.Tensor:
    """A bucket's bytes (a uint8 view of its flat tensor), once its values are in place."""
    if bucket.event is not None:
        bucket.event.synchronize()
    return bucket.flat.detach().view(torch.uint8)[: bucket.nbytes]


def views(raw: torch.Tensor, header: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` of every row of `header`, views of the bucket's bytes `raw` (uint8)."""
    dtype = _DTYPES.get(header["dtype"])
    if dtype is None:
        raise ValueError(f"weights to a generator: dtype {header['dtype']!r} is not one this receiver reads "
                         f"({sorted(_DTYPES)})")
    values = raw[: int(header["nbytes"])].view(dtype)
    for name, shape, offset, numel in header["entries"]:
        yield name, values[offset : offset + numel].view(shape)
