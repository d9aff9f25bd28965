"""An engine's parts, built and wired in one place, and closed in one place.

[Note: build order]
One pass down. The optimizer's groups are checked and chosen first, on the
model's own parameters (zero3.optim.param_groups: a bad group changes
nothing); the leaves are marked; then the partition stage
(zero3.partition.partitioner's `partition_model`): parameters are partitioned
(what zero3.Init did not) and grouped into units; the tiers lay the 16-bit
shards out (memory, host, disk); the gradient
shards come before the reducer and the optimizer, which both use them; the
reducer comes before the optimizer, whose sub-groups are cut to fit the
reducer's idle scratch; the coordinator and the gradient hooks come last,
since they drive all of the above.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zero3.comm import Communicator
from zero3.config import Zero3Config
from zero3.engine_state import buffers_of, bytes_by_state, state_list
from zero3.enums import OffloadDevice, OffloadStateType
from zero3.moe import expert_parallel
from zero3.moe.experts import ExpertLayer, check_autoep_size, find_experts
from zero3.offload.disk import FileIO, ThreadPoolFileIO
from zero3.offload.host import HostBufferPool
from zero3.offload.manager import StateOffloader
from zero3.offload.param_tier import DiskShardTier
from zero3.offload.tiers import (
    check_free_space, disk_needs, grad_device, lay_out_params, optimizer_states, step_device,
)
from zero3.optim.param_groups import plan_groups
from zero3.optim.spec import OptimizerSpec, probe
from zero3.partition import ds_attributes, param_dict
from zero3.partition.collectives import GradReduce, ParamGather, QuantizedGradReduce, gather_full_fp32
from zero3.partition.flat_buffer import FlatBuffer
from zero3.partition.lean import go_lean, in_effect as lean_in_effect, lean_units, masters_are_shards
from zero3.partition.leaf_modules import mark_leaves
from zero3.partition.partitioner import partition_model
from zero3.partition.sharded_param import ATTR, ShardedParam, mark_released, sharded
from zero3.shard_mesh import ShardMesh
from zero3.partition.secondary import SecondaryShards
from zero3.partition.unit import GatherUnit, Hold, UnitState, unit_of
from zero3.passes.coordinator import ParamCoordinator
from zero3.step.early_step import EarlySteps
from zero3.passes.grad_hooks import BackwardPass
from zero3.passes.grad_reducer import GradientReducer
from zero3.step.grad_shards import GradShards, made_on_demand
from zero3.step.loss_scaler import DynamicLossScaler, LossScaler, build_loss_scaler
from zero3.step.layout import steps_on_its_gradients
from zero3.step.optimizer import ZeroOptimizer
from zero3.step_protocol import Owed, StepProtocol

log = logging.getLogger("zero3")

ParamGroups = list[tuple[list[ShardedParam], dict[str, Any]]]


@dataclass
class EngineParts:
    module: nn.Module
    device: torch.device
    units: list[GatherUnit]
    persistent_unit: GatherUnit | None
    sharded_params: list[ShardedParam]
    disk: FileIO
    host_pool: HostBufferPool
    lp_buffers: list[FlatBuffer]
    param_disk: DiskShardTier | None
    grads: GradShards | None
    reducer: GradientReducer
    loss_scaler: LossScaler | DynamicLossScaler
    optimizer: ZeroOptimizer | None
    coordinator: ParamCoordinator
    backward: BackwardPass
    offloader: StateOffloader
    secondary: SecondaryShards | None  # hpZ's (zero3.partition.secondary)
    protocol: StepProtocol  # every agreement of a step and between steps (zero3.step_protocol)
    lean: bool = False  # some units' 16-bit shards are cast from the masters (zero3.partition.lean)

    @property
    def all_units(self) -> list[GatherUnit]:
        return self.units + ([self.persistent_unit] if self.persistent_unit is not None else [])

    def state_buffers(self, state: OffloadStateType) -> list[FlatBuffer]:
        return state_buffers(self.lp_buffers, self.optimizer, state)

    def refresh_gathered(self, views_follow: bool = False) -> None:
        """Units still gathered (persistent, pinned) get the parameters' new values. `views_follow`: the
        shards were written in place (a step), so a unit whose parameters view its shard (a world of one)
        has them already."""
        for unit in self.all_units:
            if unit.state is not UnitState.SHARDED and not (views_follow and unit.gathers_in_place):
                unit.reshard()
                unit.unshard()

    def repair_lp(self, where: str) -> None:
        """16-bit shards that do not follow their masters (a step failed on disk after writing some, or
        a load put new masters in) are rewritten from the masters, and what is gathered follows.

        `lp_stale` is the same on every rank (the step and the load set it everywhere), so every rank
        comes here together; if the rewrite fails on one (its disk), every rank raises before the
        gathers that follow, and the shards stay stale everywhere, to be repaired at the next try."""
        optimizer = self.optimizer
        if optimizer is None or not optimizer.lp_stale:
            return
        failure: Exception | None = None
        try:
            optimizer.repair_lp()
        except Exception as error:  # noqa: BLE001 - every rank raises it, below
            failure = error
        self.protocol.raise_together(where, failure, undo=lambda: setattr(optimizer, "lp_stale", True))
        self.refresh_gathered()

    def check_between_steps(self, what: str) -> None:
        """Refuse `engine.<what>()` inside a pass or a GatheredParameters block."""
        if self.coordinator.in_forward or self.coordinator.in_backward:
            raise RuntimeError(f"engine.{what}() was called inside a forward or backward; call it between steps")
        pinned = [unit.label for unit in self.all_units if unit.holds(Hold.PIN)]
        if pinned:
            raise RuntimeError(
                f"engine.{what}() was called inside GatheredParameters (gathered: {pinned}); call it after the block"
            )

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes of model state, by state (the 16P/N of ZeRO-3)."""
        states = bytes_by_state(state_list(self.lp_buffers, self.optimizer))
        states["persistent_params"] = self.persistent_unit.unsharded_nbytes() if self.persistent_unit else 0
        states["hpz_secondary"] = self.secondary.nbytes if self.secondary is not None else 0
        states["total"] = sum(states.values())
        # Scratch, not model state: reported beside the total, not in it.
        states["contiguous_grad_buffer"] = self.reducer.scratch.nbytes if self.reducer.scratch is not None else 0
        return states

    def close(self) -> None:
        """Close every part, the users of a part before the part (the engine is being destroyed)."""
        self.protocol.close()
        self.offloader.close()
        self.coordinator.release_all()
        self.coordinator.remove()
        self.backward.close()
        for unit in self.all_units:
            unit.close()
        for module in self.module.modules():
            param_dict.uninstall(module)
        for sp in self.sharded_params:
            sp.param.data = torch.empty(0, dtype=sp.dtype, device=self.device)
            mark_released(sp.param)
            if hasattr(sp.param, ATTR):
                delattr(sp.param, ATTR)
            ds_attributes.take_off(sp.param)
            sp.lp_slot = sp.lean_master = None
        self.reducer.close()
        self.reducer.scratch = None
        for buffer in self.lp_buffers:
            buffer.release("was freed: this zero3 engine was destroyed")
        if self.secondary is not None:
            self.secondary.drop_buffer()
        if self.param_disk is not None:
            self.param_disk.close()
        if self.optimizer is not None:
            self.optimizer.close()
        if self.grads is not None:
            self.grads.close()
        self.disk.close()
        self.host_pool.clear()

    def forget(self) -> None:
        """After `close`: hold none of the closed parts (a destroyed engine has no units, parameters,
        optimizer or gradient shards)."""
        self.units, self.persistent_unit, self.sharded_params = [], None, []
        self.optimizer = self.grads = None


def build(
    model: nn.Module, config: Zero3Config, comm: Communicator, gather: ParamGather, device: torch.device,
    model_parameters: Iterable[Any] | None, rank: int, spec: OptimizerSpec | None, gradient_accumulation_steps: int,
    protocol: StepProtocol,
) -> EngineParts:
    """Partition `model` and build every part around it, wired (see the Note); `spec` is the
    optimizer (from the config or the client's), None for an engine that does not train;
    `gradient_accumulation_steps` the engine's resolved count (a plain loss.backward() divides by it);
    `protocol` the engine's step protocol, which every part agrees through (zero3.step_protocol)."""
    zc = config.zero_optimization
    compute_dtype = config.compute_dtype
    # What the optimizer keeps per element, learned before anything is partitioned or reserved.
    state_layout = probe(spec, step_device(config, device)) if spec is not None else None
    group_plan = plan_groups(model, model_parameters, spec) if spec is not None else []
    # After the groups are checked (a bad one leaves the model whole), before anything reads the expert weights.
    expert_gather = share_out_experts(model, config, comm)
    leaf = zc.leaf_module
    leaves = mark_leaves(model, leaf.classes, leaf.names, leaf.name_suffixes, zc.stage3_module_granularity_threshold)
    parted = partition_model(model, gather, device, compute_dtype, leaves, zc, expert_gather)
    units, persistent_unit = parted.units, parted.persistent_unit
    all_units, sharded_params = parted.all_units, parted.sharded_params
    for unit in all_units:
        unit.sanity_checks = zc.enable_sanity_checks
    named = dict(model.named_parameters())  # (the names the plan holds: partitioning kept them)
    groups: ParamGroups = [([sharded(named[name]) for name in names], options)  # type: ignore[misc]
                           for names, options in group_plan]

    # One I/O layer and one host-buffer pool for the tiers and for offload_states (zero3.offload).
    disk = ThreadPoolFileIO(rank, config.aio.block_size, config.aio.thread_count * config.aio.queue_depth)
    host_pool = HostBufferPool(device)
    trainable = [sp for sps, _ in groups for sp in sps]
    optimizer_state_count = 1 + len(state_layout.elementwise) if state_layout is not None else 0
    # Lean memory mode: the units whose 16-bit shards are cast from their masters keep none (zero3.partition.lean).
    lean = lean_units(all_units, set(trainable)) if spec is not None and lean_in_effect(
        zc.lean_memory, compute_dtype, zc.offload_optimizer.device, zc.offload_param.device) else []
    check_free_space(disk_needs(
        config, all_units, compute_dtype, sum(sp.shard_numel for sp in trainable), optimizer_state_count,
    ), protocol)
    layout = lay_out_params(config, [unit for unit in all_units if unit not in lean], compute_dtype, device, disk)

    # The reduced gradients (lp_grads): the reducer adds into them, the optimizer steps from them.
    grads = None
    if spec is not None:
        # Lean memory mode, and a CPU device reducing across ranks, make each chunk of shards at its first
        # gradient and drop it at the step (the Notes there).
        on_demand = made_on_demand(bool(lean), device, comm.alone, zc.offload_optimizer.device != OffloadDevice.nvme,
                                   zc.offload_optimizer.super_offload)
        grads = GradShards(trainable, config.grad_accum_dtype, grad_device(config, device) or device,
                           on_demand=on_demand,
                           group_of={sp: unit for unit in all_units for sp in unit.params})
    reducer = GradientReducer(
        grad_reduce(gather.mesh, comm), trainable, config.communication_dtype, device,
        zc.reduce_bucket_size, zc.overlap_comm, config.gradient_predivide_factor, config.prescale_gradients, grads,
        GradReduce(expert_gather.mesh, comm, own_group=True) if expert_gather is not None else None,
    )
    loss_scaler = build_loss_scaler(config.fp16)
    optimizer = None
    if spec is not None:
        assert grads is not None and state_layout is not None
        sub_group_size = zc.sub_group_size
        in_memory = zc.offload_optimizer.device == OffloadDevice.none  # the states on the device: not transactional
        if in_memory and not steps_on_its_gradients(grads, device, False, muon=spec.muon is not None):
            # A sub-group's fp32 gradients are made in the idle scratch bucket: no larger than it, so
            # the step allocates nothing (a fresh 4 bytes per element of the sub-group otherwise).
            scratch_bytes = reducer.scratch_numel() * reducer.dtype.itemsize
            sub_group_size = max(1, min(sub_group_size, scratch_bytes // 4))
        # The step makes its fp32 gradients in the reduce bucket, idle by then (see ZeroOptimizer).
        optimizer = ZeroOptimizer(
            groups, spec, state_layout, comm, device, grads, sub_group_size, config.gradient_clipping, loss_scaler,
            optimizer_states(config, device, disk, host_pool), borrow_scratch=reducer.idle_scratch,
            matrix_bucket_numel=zc.reduce_bucket_size, ignore_unused_parameters=zc.ignore_unused_parameters,
            masters_are_shards=masters_are_shards(compute_dtype, zc.offload_optimizer.device, zc.offload_param.device),
            protocol=protocol,
        )
        if spec.client is not None:
            optimizer.read_client_state(spec.client)
        if lean:
            go_lean(lean, {sp: slots.hp for sp, slots in optimizer.masters.items()}, device)
            optimizer.link_lp()
        if zc.offload_optimizer.super_offload:
            early = EarlySteps(optimizer)
            optimizer.overlap_host_step(early)
            reducer.on_landed, reducer.on_late_round = early.landed, early.late_gradients
    for sp in sharded_params:
        sp.hp_seed = None  # frozen parameters keep no master

    secondary = None
    topology = comm.topology
    if topology is not None and topology.secondary is not None and units:
        # hpZ: the persistent unit stays gathered, so only the others keep a secondary shard; shared-out
        # experts are gathered on their expert-data group, not the dense shard group hpZ's shards divide.
        dense = [unit for unit in units if unit.gather.mesh is gather.mesh]
        secondary = SecondaryShards(dense, gather.mesh, topology.secondary, comm, device, compute_dtype)
    coordinator = ParamCoordinator(
        model, units, parted.module_units, comm, gather.mesh, zc.stage3_prefetch_bucket_size,
        zc.stage3_max_live_parameters, persistent_unit, grads, secondary, protocol,
    )
    offloader = StateOffloader(
        device, disk, host_pool, functools.partial(state_buffers, layout.buffers, optimizer), reducer,
        zc.offload_param.nvme_path or zc.offload_optimizer.nvme_path,
        held_by={OffloadStateType.hp_params: OffloadStateType.lp_params}
        if optimizer is not None and optimizer.masters_are_shards else None,
        home_of=functools.partial(state_home, optimizer),
    )
    backward = BackwardPass(
        units, persistent_unit, coordinator, reducer, grads, device,
        gradient_accumulation_steps, loss_scaler,
    )
    # How this rank makes each collective the others may be in next as a rank that failed (the protocol's Note).
    protocol.bind(Owed.FORWARD, coordinator.join_forward_as_failed)
    protocol.bind(Owed.BACKWARD, backward.join_as_failed)
    if optimizer is not None:
        protocol.bind(Owed.STEP, optimizer.join_as_failed)
    coordinator.install()
    if persistent_unit is not None:
        persistent_unit.unshard()
    return EngineParts(
        model, device, units, persistent_unit, sharded_params, disk, host_pool, layout.buffers, layout.disk_tier,
        grads, reducer, loss_scaler, optimizer, coordinator, backward, offloader, secondary, protocol, bool(lean),
    )


def share_out_experts(model: nn.Module, config: Zero3Config, comm: Communicator) -> ParamGather | None:
    """With `expert_parallel`: the model's expert layers checked (on every rank, before any is changed), then
    shared out over the topology's expert-parallel groups (zero3.moe.expert_parallel's Note); the gather of
    their shares, on the expert-data groups. None without expert parallelism."""
    size = config.expert_parallel.size
    topology = comm.topology
    if size == 1 or topology is None or topology.experts is None or topology.expert_data is None:
        return None
    layers = find_experts(model)
    check_autoep_size(layers, size, topology.world_size, topology.nodes.ranks_per_node)
    check_init_partitioned_experts(layers)
    expert_parallel.share_out_experts(layers, topology.experts.shard_rank, size, topology.experts.shard_group,
                                      whole_values=out_of_init_partition)
    return ParamGather(topology.expert_data, comm, own_group=True)


def check_init_partitioned_experts(layers: list[ExpertLayer]) -> None:
    """An expert weight partitioned by zero3.Init leaves its partition whole: its gather unit holds only its
    layer's expert weights (Init makes a unit of a module's own parameters, and an experts module has no other)."""
    for layer in layers:
        weights = {id(getattr(layer.module, name)) for name in layer.weights}
        for name in layer.weights:
            sp = sharded(getattr(layer.module, name))
            unit = unit_of(sp) if sp is not None else None
            others = [other.name for other in unit.params if id(other.param) not in weights] if unit else []
            if others:
                raise ValueError(f"expert layer {layer.name!r}: zero3.Init partitioned {name} together with "
                                 f"{', '.join(others)}, which are not the layer's expert weights")


def out_of_init_partition(param: nn.Parameter) -> torch.Tensor | None:
    """A zero3.Init-partitioned expert weight's whole fp32 values (collective over its unit's group, every rank
    in the same order), the weight taken out of the partition as a destroyed engine releases a parameter;
    None for a weight that holds its values."""
    sp = sharded(param)
    if sp is None:
        return None
    unit = unit_of(sp)
    assert unit is not None
    values = gather_full_fp32(sp, unit.gather, sp.placeholder.device)
    delattr(param, ATTR)
    ds_attributes.take_off(param)
    return values


def grad_reduce(mesh: ShardMesh, comm: Communicator) -> GradReduce:
    """The gradient reduction: qgZ's two quantized all-to-alls where the topology made their groups
    (`zero_quantized_gradients`), else a reduce-scatter."""
    topology = comm.topology
    if topology is None or topology.grads_inside is None or topology.grads_across is None or not mesh.sharded:
        return GradReduce(mesh, comm)
    return QuantizedGradReduce(mesh, comm, topology.grads_inside.shard_size, topology.grads_across.shard_size)


def state_home(optimizer: ZeroOptimizer | None, state: OffloadStateType) -> torch.device | None:
    """Where a state that holds no memory now has its place: gradient shards made on demand are made on
    their device (zero3.offload.manager's [Note: states that hold no memory now])."""
    if state is OffloadStateType.lp_grads and optimizer is not None:
        return optimizer.grads.device
    return None


def state_buffers(lp_buffers: list[FlatBuffer], optimizer: ZeroOptimizer | None, state: OffloadStateType) -> list[FlatBuffer]:
    """The flat buffers that hold a state now (the engine's one list, zero3.engine_state)."""
    return buffers_of(state_list(lp_buffers, optimizer), state)
