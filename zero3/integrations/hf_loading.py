"""A pretrained Hugging Face model loaded straight into its partitions.

`from_pretrained(LlamaForCausalLM, path, zero3_config=...)` builds the model
under `zero3.Init` (each module partitioned as its constructor returns) and
then streams the checkpoint's safetensors into the partitions, one tensor at
a time: every rank reads the tensor and keeps its own shard of it (no
collective, no gather; only the rows holding its shard are read), so no rank
holds more than its shards plus a slice of the tensor being read. Names follow `save_pretrained`'s (the model's own
`named_parameters`, tied weights under either name).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

import zero3
from zero3.integrations.hf_config import read_zero3_config
from zero3.partition.sharded_param import require_sharded

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards, or the single file."""
    index = path / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}: not a safetensors checkpoint")


def stream_into_partitions(model: nn.Module, files: list[Path]) -> list[str]:
    """Write every tensor of `files` into its parameter's partition (or its buffer); returns the names
    loaded. A name the model does not have, or a parameter no file has (a tied one aside), is an error
    naming it, raised before anything else is read (the files' keys are read first)."""
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    keys: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            keys.update((key, file) for key in handle.keys())
    ignored = [str(pattern) for pattern in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unknown = [key for key in keys if key not in params and key not in buffers
               and not any(re.search(pattern, key) for pattern in ignored)]
    if unknown:
        raise ValueError(f"the checkpoint has tensors the model does not: {', '.join(sorted(unknown)[:10])}"
                         + (f" (and {len(unknown) - 10} more)" if len(unknown) > 10 else ""))
    covered = {id(params[key]) for key in keys if key in params}
    missing = [name for name, param in params.items() if id(param) not in covered]
    if missing:
        raise ValueError(f"the checkpoint lacks parameters of the model: {', '.join(missing[:10])}"
                         + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""))
    loaded: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key in params:
                    sp = require_sharded(params[key], "from_pretrained")
                    stored = handle.get_slice(key)
                    if tuple(stored.get_shape()) != tuple(sp.shape):
                        raise ValueError(f"{key}: the checkpoint's shape {tuple(stored.get_shape())} is not the "
                                         f"model's {tuple(sp.shape)}")
                    if stored.get_shape():
                        sp.write_shard(_own_shard(sp, stored))
                    else:  # a 0-d parameter: one element, read whole
                        sp.write_full(handle.get_tensor(key).to(sp.dtype))
                    loaded.append(key)
                elif key in buffers:
                    with torch.no_grad():
                        buffers[key].copy_(handle.get_tensor(key))
                    loaded.append(key)
    return loaded


def _without_auto(config: Any) -> Any:
    """The config without its unfilled "auto" values (Init reads only what is written out)."""
    if isinstance(config, dict):
        return {key: _without_auto(value) for key, value in config.items() if value != "auto"}
    return config


def _own_shard(sp: Any, stored: Any) -> torch.Tensor:
    """This rank's shard of a stored tensor, reading only the rows that hold it (a safetensors slice)."""
    start, end = sp.shard_range()
    shard = torch.zeros(sp.shard_numel, dtype=sp.dtype)
    if end <= start:
        return shard
    shape = tuple(stored.get_shape())
    row = 1
    for size in shape[1:]:
        row *= size
    first, last = start // row, -(-end // row)  # the rows [first, last) cover [start, end)
    rows = stored[first:last].reshape(-1)
    shard[: end - start].copy_(rows[start - first * row : end - first * row])
    return shard


def from_pretrained(
    model_class: Any, path: str | os.PathLike[str], zero3_config: dict[str, Any] | str | os.PathLike[str],
    dtype: torch.dtype | None = None, **config_kwargs: Any,
) -> nn.Module:
    """`model_class` (a transformers PreTrainedModel class) built partitioned from the local directory
    `path` (its `config.json` and safetensors), streamed one tensor at a time. `zero3_config` is the
    training config, Hugging Face's "auto" template included; its precision picks the shards' dtype
    (`dtype` overrides it: pass torch.bfloat16 when the Trainer's `bf16=True` fills an "auto" there).
    `config_kwargs` update the model config. The model then goes to `zero3.initialize` or
    `Zero3Trainer` like any model built under zero3.Init."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory: from_pretrained loads a local model directory")
    files = safetensors_files(directory)
    model_config = model_class.config_class.from_pretrained(directory, **config_kwargs)
    from transformers.initialization import no_init_weights

    # No random init (the checkpoint overwrites every parameter, checked before anything is read): under
    # zero3.Init an init would gather each module's parameters again to write them (the whole model's worth
    # of churn, and a higher peak of host memory per rank).
    with no_init_weights(), zero3.Init(config=_without_auto(read_zero3_config(zero3_config)), dtype=dtype):
        model = model_class(model_config)
    stream_into_partitions(model, files)
    model.eval()  # as transformers' from_pretrained leaves it
    return model
