"""Turning a module's whole parameters into shards, and shards into gather units.

`Partitioner` shards one module's own parameters (what `zero3.Init` calls as each constructor
returns, and the engine's build for whatever Init did not reach). `build_units` then groups the
shards: one unit per module (or per leaf module), plus one persistent unit of the small
parameters, and records which units each module's forward must hold. Units are per module, not
chosen by the user as FSDP2's `fully_shard` calls are. `partition_model` is the engine build's
whole partition stage, these steps in order (zero3.engine.build's [Note: build order]).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from zero3.accelerator import untouched_zeros
from zero3.comm import Communicator
from zero3.config import ZeroConfig
from zero3.moe.expert_parallel import expert_share
from zero3.partition import ds_attributes, param_dict
from zero3.partition.collectives import ParamGather, gather_full_fp32
from zero3.partition.external import external_parameters
from zero3.partition.flat_buffer import FlatBuffer
from zero3.partition.quantize import QuantizedShards
from zero3.partition.sharded_param import ATTR, ShardedParam, sharded
from zero3.partition.unit import GatherUnit, unit_of


@dataclass
class PartitionedModel:
    """A model's parameters as the engine holds them: its gather units, the units each module's forward
    holds, the persistent unit (small parameters kept gathered) and every sharded parameter, unit by unit."""

    units: list[GatherUnit]
    module_units: dict[nn.Module, list[GatherUnit]]
    persistent_unit: GatherUnit | None

    @property
    def all_units(self) -> list[GatherUnit]:
        return self.units + ([self.persistent_unit] if self.persistent_unit is not None else [])

    @property
    def sharded_params(self) -> list[ShardedParam]:
        return [sp for unit in self.all_units for sp in unit.params]


def partition_model(
    model: nn.Module, gather: ParamGather, device: torch.device, dtype: torch.dtype,
    leaves: dict[nn.Module, nn.Module], zc: ZeroConfig, expert_gather: ParamGather | None = None,
) -> PartitionedModel:
    """The build's partition stage (collective): what zero3.Init did not partition (or partitioned over
    another shard group) sharded on the engine's group, buffers moved, every parameter named; then the
    units, with `leaves` (zero3.partition.leaf_modules' `mark_leaves`) gathered whole, and qwZ's quantized
    gathers where the config asks for them. Shared-out experts (zero3.moe.expert_parallel) are sharded over
    `expert_gather`'s mesh, each module's in a unit of their own."""
    _partition(model, gather, device, dtype, expert_gather)
    units, module_units, persistent_unit = build_units(
        model, gather, zc.stage3_param_persistence_threshold, zc.stage3_model_persistence_threshold, leaves,
        expert_gather,
    )
    _quantize_gathers(units, zc.zero_quantized_weights, zc.zero_quantized_nontrainable_weights)
    return PartitionedModel(units, module_units, persistent_unit)


class Partitioner:
    """Partitions parameters into per-module gather units.

    Every rank shards rank 0's values (one coalesced broadcast per module), as
    DeepSpeed does, so ranks seeded differently still hold one model.
    """

    def __init__(self, gather: ParamGather, device: torch.device, dtype: torch.dtype,
                 expert_gather: ParamGather | None = None) -> None:
        self.gather = gather
        self.expert_gather = expert_gather  # an expert weight's (zero3.moe.expert_parallel): its expert-data mesh
        self.device = device
        self.dtype = dtype

    def partition_module(self, module: nn.Module, label: str) -> GatherUnit | None:
        """`module`'s own parameters that are not partitioned yet, sharded into one unit (None where there are
        none); its reads of a partitioned parameter are reported from now on (zero3.partition.param_dict)."""
        fresh = [(name, p) for name, p in module._parameters.items() if p is not None and sharded(p) is None]
        experts = [(name, p) for name, p in fresh if expert_share(p) is not None]
        dense = [(name, p) for name, p in fresh if expert_share(p) is None]
        unit = self._shard(module, label, dense, self.gather) if dense else None
        if experts:
            if self.expert_gather is None:
                raise ValueError(f"{label or type(module).__name__}: its experts were shared out "
                                 "(zero3.moe.share_out_experts), but this layout has no expert-data mesh")
            # Every rank already holds rank 0's values of its share: nothing to broadcast.
            self._shard(module, label, experts, self.expert_gather)
        param_dict.install(module)
        return unit

    def _shard(self, module: nn.Module, label: str, fresh: list[tuple[str, nn.Parameter]],
               gather: ParamGather) -> GatherUnit:
        agreed = gather is self.expert_gather
        values = self._local_values([p for _, p in fresh]) if agreed else self._broadcast_values([p for _, p in fresh])
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
            ShardedParam(p, f"{label}.{name}" if label else name, gather.mesh, self.dtype, self.device)
            for name, p in fresh
        ]
        for sp in sps:
            ds_attributes.wear(sp)
        unit = GatherUnit(sps, gather, label or type(module).__name__)
        # Values to come (a load writes them) are, in host memory, zeros no one has written; else every
        # element is written below (each shard, its padding too), with no fill first.
        untouched = all(full is None for full in values) and self.device.type == "cpu"
        storage = untouched_zeros(unit.shard_numel, self.dtype) if untouched else \
            torch.empty(unit.shard_numel, dtype=self.dtype, device=self.device)
        unit.assign_lp(FlatBuffer(f"lp:{unit.label}", storage), 0)
        for sp, full in zip(sps, values):
            if full is not None:
                sp.copy_shard_of(full, sp.lp_shard())
            elif not untouched:
                sp.lp_shard().zero_()
            # The fp32 master starts from the exact init; an fp32 shard already is it (no second copy).
            if self.dtype != torch.float32:
                sp.hp_seed = sp.shard_of(full) if full is not None else torch.zeros(sp.shard_numel, device=self.device)
            sp.set_released()
        return unit

    def _local_values(self, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
        """`params`' own fp32 values on the engine device (values every rank already agreed on)."""
        return [p.detach().to(self.device, torch.float32) for p in params]

    def _broadcast_values(self, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
        """Rank 0's fp32 values of `params`, moved to the engine device. A parameter on the meta device
        has no values (a module built with skip_init): zeros, until a load writes them; None for such a
        parameter where there is no other rank to send them to."""
        assert self.gather.comm is not None
        if self.gather.comm.job_alone and all(p.is_meta for p in params):
            return [None for _ in params]
        flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=self.device)
        out, cursor = [], 0
        with torch.no_grad():
            for p in params:
                value = flat[cursor : cursor + p.numel()]
                if p.is_meta:
                    value.zero_()
                else:
                    value.copy_(p.detach().reshape(-1))
                out.append(value.view(p.shape))
                cursor += p.numel()
        self.gather.comm.broadcast(flat, src=0)
        return out


def build_units(
    model: nn.Module, gather: ParamGather, threshold: int, model_threshold: int = sys.maxsize,
    leaves: dict[nn.Module, nn.Module] | None = None, expert_gather: ParamGather | None = None,
) -> tuple[list[GatherUnit], dict[nn.Module, list[GatherUnit]], GatherUnit | None]:
    """One unit per module (the parameters it owns first), or per leaf module (its descendants' too:
    `leaves`, zero3.partition.leaf_modules' `leaf_of` map; None: no leaves), one for
    every parameter of at most `threshold` elements (kept whole: the persistent unit) while the
    persistent ones total at most `model_threshold` elements (DeepSpeed's rule, in parameter order),
    and each module's units to gather. A module's shared-out expert weights are a unit of their own on
    `expert_gather` (never persistent, never in a leaf's unit: they lie on another mesh)."""
    leaves = leaves or {}
    seen: set[int] = set()
    # (label, its parameters) in module order; a leaf's list also collects its descendants'.
    groups: list[tuple[str, list[ShardedParam]]] = []
    expert_groups: list[tuple[str, list[ShardedParam]]] = []
    leaf_group: dict[nn.Module, list[ShardedParam]] = {}
    persistent: list[ShardedParam] = []
    persistent_numel = 0
    for name, module in model.named_modules():
        leaf = leaves.get(module)
        if leaf is module:
            leaf_group[leaf] = []
            groups.append((name or type(module).__name__, leaf_group[leaf]))
        own = leaf_group[leaf] if leaf is not None else []
        experts: list[ShardedParam] = []
        for param in module._parameters.values():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            sp = sharded(param)
            assert sp is not None
            sp.leaf = leaf is not None
            if expert_share(param) is not None:
                experts.append(sp)
            elif sp.numel <= threshold and persistent_numel + sp.numel <= model_threshold:
                persistent.append(sp)
                persistent_numel += sp.numel
            else:
                own.append(sp)
        if leaf is None and own:
            groups.append((name or type(module).__name__, own))
        if experts:
            expert_groups.append((name or type(module).__name__, experts))
    units = [GatherUnit(params, gather, label) for label, params in groups if params]
    if expert_groups:
        assert expert_gather is not None, "shared-out experts need the expert-data mesh's gather"
        units += [GatherUnit(params, expert_gather, label) for label, params in expert_groups]
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


def _partition(model: nn.Module, gather: ParamGather, device: torch.device, dtype: torch.dtype,
               expert_gather: ParamGather | None = None) -> None:
    """Partition what zero3.Init did not, move buffers, and name every parameter. A parameter zero3.Init (or
    zero3.MiCS_Init) partitioned over another number of ranks than the engine's shard group (MiCS, a mesh)
    is gathered whole and partitioned again, one module at a time (so no more than a module is whole)."""
    partitioner = Partitioner(gather, device, dtype, expert_gather)
    for name, module in model.named_modules():
        _unpartition_other_layout(module, gather, device)
        partitioner.partition_module(module, name)
        for key, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[key] = buf.to(device)
    for name, param in model.named_parameters():
        sp = sharded(param)
        assert sp is not None
        sp.name = name
        if sp.dtype != dtype or sp.placeholder.device != device:
            raise ValueError(
                f"parameter {name} was partitioned as {sp.dtype} on {sp.placeholder.device}, but the engine "
                f"computes in {dtype} on {device}: pass the same config to zero3.Init"
            )


def _unpartition_other_layout(module: nn.Module, gather: ParamGather, device: torch.device) -> None:
    """`module`'s own parameters that zero3.Init sharded over another shard group than the engine's, made
    whole again (collective, over the group they were sharded on, in module order on every rank)."""
    pending = [(param, sp) for param in module._parameters.values()
               if param is not None and (sp := sharded(param)) is not None and expert_share(param) is None
               and sp.mesh.shard_size != gather.mesh.shard_size]
    if not pending:
        return
    fulls = [gather_full_fp32(sp, ParamGather(sp.mesh, Communicator()), device) for _, sp in pending]
    units = {id(unit): unit for _, sp in pending if (unit := unit_of(sp)) is not None}
    for unit in units.values():
        unit.close()  # zero3.Init's unit: it let go of these parameters, so the engine's layout takes them
    for (param, _), full in zip(pending, fulls):
        delattr(param, ATTR)
        with torch.no_grad():
            param.data = full


def _quantize_gathers(units: list[GatherUnit], weights: bool, nontrainable: bool) -> None:
    """qwZ: the units' all-gathers carry int8 blocks (zero3.partition.quantize), every unit's with
    `zero_quantized_weights`, only frozen units' with `zero_quantized_nontrainable_weights`. The persistent
    unit, gathered once and kept, and every path that keeps what it gathers (the engine's own `gather`)
    stay exact."""
    if not (weights or nontrainable):
        return
    quantized: dict[int, ParamGather] = {}  # one quantized gather per mesh (the dense one, the experts')
    for unit in units:
        gather = unit.gather
        if gather.mesh.sharded and (weights or not any(sp.param.requires_grad for sp in unit.params)):
            if id(gather) not in quantized:
                quantized[id(gather)] = ParamGather(gather.mesh, gather.comm, QuantizedShards(), gather.own_group)
            unit.gather = quantized[id(gather)]
