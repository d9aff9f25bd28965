"""Weights to a generator in this process: a Hugging Face model, or any module, gets the engine's weights.

No `load_state_dict`: each whole parameter is copied into the generator's parameter of the mapped name as its
bucket arrives (zero3.weights.buckets), so the extra memory is the buckets in flight, never a second
copy of the model. Tied weights arrive once (under their first name) and reach every name they are tied to,
since those are one parameter in the generator too. Every name is checked (it exists, its shape matches) on
every rank before anything is gathered or copied, and the ranks agree on the result.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zero3.weights import full_params
from zero3.weights.wire import DEFAULT_BUCKET_BYTES, NameMap, mapped


def load_into(engine: Any, module: nn.Module | None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              name_map: NameMap = None, strict: bool = True) -> int:
    """Copy every parameter of `engine` (a ZeroEngine), whole, into `module`'s parameter of the mapped name
    (`name_map`: a dict, or a callable returning None for a parameter not delivered). Collective: every
    training rank calls it; a rank whose `module` is None only takes part in the gathers. `strict`: every
    parameter of `module` must receive a value. Returns the parameters copied on this rank."""
    targets = engine.protocol.agree(
        "weights.load_into", lambda: _targets(engine.module, module, name_map, strict),
        " (nothing was gathered or copied)")
    copied = 0
    with torch.no_grad():
        for name, tensor in engine.iter_full_params(dtype=None, bucket_bytes=bucket_bytes):
            target = targets.get(name)
            if target is not None:
                target.copy_(tensor)
                copied += 1
    return copied


def _targets(trained: nn.Module, module: nn.Module | None, name_map: NameMap, strict: bool
             ) -> dict[str, torch.Tensor]:
    """Each streamed name's parameter in `module` (none where `module` is None); every mismatch raises."""
    if module is None:
        return {}
    theirs = dict(module.named_parameters(remove_duplicate=False))
    targets: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for name, sp in full_params.select(trained, None):
        target_name = mapped(name, name_map)
        if target_name is None:
            continue
        target = theirs.get(target_name)
        if target is None:
            problems.append(f"{name} -> {target_name}: the generator has no such parameter")
        elif tuple(target.shape) != tuple(sp.whole_shape):  # (an expert share streams whole: [E, ...])
            problems.append(f"{name} -> {target_name}: shape {list(sp.whole_shape)} here, {list(target.shape)} there")
        else:
            targets[name] = target
    if strict:
        reached = {id(target) for target in targets.values()}
        problems += [f"{their_name}: no parameter of the engine maps to it (strict=True)"
                     for their_name, param in theirs.items() if id(param) not in reached]
    if problems:
        raise ValueError(f"weights.load_into: {len(problems)} parameters do not match:\n  " + "\n  ".join(problems))
    return targets
