"""Turning a module's whole parameters into shards, and shards into gather units.

`Partitioner` shards one module's own parameters (what `zero3.Init` calls as each constructor
returns, and the engine's build for whatever Init did not reach). `build_units` then groups the
shards: one unit per module (or per leaf module), plus one persistent unit of the small
parameters, and records which units each module's forward must hold. Units are per module, not
chosen by the user as FSDP2's `fully_shard` calls are.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from zero3.partition import param_dict
from zero3.partition.collectives import ParamGather
from zero3.partition.external import external_parameters
from zero3.partition.leaf_modules import leaf_of
from zero3.partition.flat_buffer import FlatBuffer
from zero3.partition.sharded_param import ShardedParam, sharded
from zero3.partition import ds_attributes
from zero3.partition.unit import GatherUnit, ShardSource, unit_of


class Partitioner:
    """Partitions parameters into per-module gather units.

    Every rank shards rank 0's values (one coalesced broadcast per module), as
    DeepSpeed does, so ranks seeded differently still hold one model.
    """

    def __init__(self, gather: ParamGather, device: torch.device, dtype: torch.dtype) -> None:
        self.gather = gather
        self.device = device
        self.dtype = dtype

    def partition_module(self, module: nn.Module, label: str) -> GatherUnit | None:
        fresh = [(name, p) for name, p in module._parameters.items() if p is not None and sharded(p) is None]
        param_dict.install(module)
        if not fresh:
            return None
        values = self._broadcast_values([p for _, p in fresh])
        # A parameter on the meta device cannot take real storage in place (its tensor type differs): it
        # is replaced, before anyone holds it, by one on the engine device (built this moment: skip_init),
        # as large as the module's other parameters are here for a moment.
        for index, (name, p) in enumerate(fresh):
            if p.is_meta:
                with torch._C.DisableTorchFunction():
                    real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                        requires_grad=p.requires_grad)
                module._parameters[name] = real
                fresh[index] = (name, real)
        sps = [
            ShardedParam(p, f"{label}.{name}" if label else name, self.gather.mesh, self.dtype, self.device)
            for name, p in fresh
        ]
        for sp in sps:
            ds_attributes.wear(sp)
        unit = GatherUnit(sps, self.gather, label or type(module).__name__)
        buffer = FlatBuffer.zeros(f"lp:{unit.label}", unit.shard_numel, self.dtype, self.device)
        unit.assign_lp(buffer, 0)
        for sp, full in zip(sps, values):
            seed = sp.shard_of(full).float()
            sp.lp_shard().copy_(seed)
            # The fp32 master starts from the exact init; an fp32 shard already is it (no second copy).
            sp.hp_seed = seed if self.dtype != torch.float32 else None
            sp.set_released()
        return unit

    def _broadcast_values(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Rank 0's fp32 values of `params`, moved to the engine device. A parameter on the meta device
        has no values (a module built with skip_init): zeros, until a load writes them."""
        with torch.no_grad():
            flat = torch.cat([
                torch.zeros(p.numel(), dtype=torch.float32, device=self.device) if p.is_meta
                else p.detach().reshape(-1).to(self.device, torch.float32)
                for p in params
            ])
        assert self.gather.comm is not None
        self.gather.comm.broadcast(flat, src=0)
        out, cursor = [], 0
        for p in params:
            out.append(flat[cursor : cursor + p.numel()].view(p.shape))
            cursor += p.numel()
        return out


def build_units(
    model: nn.Module, gather: ParamGather, threshold: int, model_threshold: int = sys.maxsize,
) -> tuple[list[GatherUnit], dict[nn.Module, list[GatherUnit]], GatherUnit | None]:
    """One unit per module (the parameters it owns first), or per leaf module (its descendants' too:
    zero3.partition.leaf_modules), one for every parameter of at most `threshold` elements (kept
    whole: the persistent unit) while the persistent ones total at most `model_threshold` elements
    (DeepSpeed's rule, in parameter order), and each module's units to gather."""
    leaves = leaf_of(model)
    seen: set[int] = set()
    # (label, its parameters) in module order; a leaf's list also collects its descendants'.
    groups: list[tuple[str, list[ShardedParam]]] = []
    leaf_group: dict[nn.Module, list[ShardedParam]] = {}
    persistent: list[ShardedParam] = []
    persistent_numel = 0
    for name, module in model.named_modules():
        leaf = leaves.get(module)
        if leaf is module:
            leaf_group[leaf] = []
            groups.append((name or type(module).__name__, leaf_group[leaf]))
        own = leaf_group[leaf] if leaf is not None else []
        for param in module._parameters.values():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            sp = sharded(param)
            assert sp is not None
            sp.leaf = leaf is not None
            if sp.numel <= threshold and persistent_numel + sp.numel <= model_threshold:
                persistent.append(sp)
                persistent_numel += sp.numel
            else:
                own.append(sp)
        if leaf is None and own:
            groups.append((name or type(module).__name__, own))
    units = [GatherUnit(params, gather, label) for label, params in groups if params]
    persistent_unit = None
    if persistent:
        persistent_unit = GatherUnit(persistent, gather, "<persistent>", persistent=True)
    module_units: dict[nn.Module, list[GatherUnit]] = {}
    for module in model.modules():
        needed: list[GatherUnit] = []
        leaf = leaves.get(module)
        if leaf is not None and leaf is not module:
            module_units[module] = needed  # inside a leaf: the leaf's forward holds the whole unit
            continue
        params = [*module._parameters.values(), *external_parameters(module)]
        if leaf is module:
            params += [p for sub in module.modules() for p in [*sub._parameters.values(), *external_parameters(sub)]]
        for param in params:
            sp = sharded(param) if param is not None else None
            unit = unit_of(sp) if sp is not None else None
            if unit is not None and not unit.persistent and unit not in needed:
                needed.append(unit)
        module_units[module] = needed
    return units, module_units, persistent_unit


def consolidate_lp(
    units: list[GatherUnit], dtype: torch.dtype, device: torch.device, name: str = "lp_params",
    source: ShardSource | None = None,
) -> FlatBuffer:
    """Move these units' shards into ONE flat 16-bit buffer (part or all of the `lp_params` state);
    `source` brings each unit's shard to the compute device when the buffer is not there."""
    flat = FlatBuffer.zeros(name, sum(unit.shard_numel for unit in units), dtype, device, state="lp_params")
    cursor = 0
    for unit in units:
        shards = [sp.lp_slot.read() for sp in unit.params]  # type: ignore[union-attr]
        unit.assign_lp(flat, cursor, source)
        torch._foreach_copy_([sp.lp_shard() for sp in unit.params], shards)
        cursor += unit.shard_numel
    return flat
