"""The sharded optimizer: fp32 master shards, flat optimizer states, clipping, loss scaling.

[Note: optimizer layout]
Trainable parameters are laid out in optimizer-group order in flat buffers
with one shared offset map: `hp_params` (fp32 master), `lp_grads` (the
reduced gradients, in `grad_accum_dtype`: zero3.step.grad_shards, built by
the engine and shared with the reducer), and one per elementwise state of the
optimizer (Adam: `exp_avg`, `exp_avg_sq`; together the `optim_states`; see
zero3.optim.spec). The fp32 buffers belong to a tier (zero3.offload's
optimizer tier): on the device, in host memory (ZeRO-Offload) or in files
(ZeRO-Infinity); `lp_grads` stays in memory in every tier (host memory with
ZeRO-Offload). Each group's range is cut into sub-groups of
`sub_group_size` elements (the last one shorter), splitting a
parameter's shard where a cut falls in it: the update is elementwise, so a
shard stepped in two pieces gets the same values as in one, and a disk
tier's windows stay `sub_group_size` however large one parameter is (a
50k-vocab embedding would otherwise size them all). A step walks the
sub-groups: the tier hands each one's window to `_step_sub_group`, which
makes the sub-group's fp32 gradients from `lp_grads` (they exist only while
it steps), points torch's optimizer at the window (each piece's master a
view, its states views, in the optimizer state) and steps it. So a
parameter that got no gradient this step is skipped exactly as torch skips
it. A piece's state is created by torch itself at its first step (as the
class does it: SGD's momentum is the first gradient, Adagrad's sum starts at
`initial_accumulator_value`) and then moved into the flat buffers
(`_adopt`); from then on torch updates it in place there. The new 16-bit
shards are written from each sub-group's masters once it has stepped (or,
when they live on disk beside masters kept in memory, after the walk: see
`step`).

[Note: masters that are the shards]
An fp32 engine whose shards and masters share one memory (neither tier
offloaded: `masters_are_shards`) keeps one copy: each parameter's master
slot is its shard slot in `lp_params`, there is no `hp_params` buffer, and a
step updates the shards in place (nothing to write back). The optimizer
order still names each parameter's place in `lp_grads`, the moments and the
sub-groups (`order_offsets`); only the masters live in the shards' layout, so
each piece's master is bound to a view of its shard. Checkpoints, the
accessors and `offload_states` see the same masters through the slots; the
`hp_params` state holds no bytes, and moving `lp_params` moves the masters.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from zero3.comm import Communicator
from zero3.offload.disk import StepIOError
from zero3.offload.optimizer_tier import OptimizerStates
from zero3.partition.flat_buffer import FlatBuffer, Slot
from zero3.optim import spec as optimizer_spec
from zero3.optim.muon import Matrix, MatrixExchange, MuonAdamW, direction
from zero3.optim.spec import OptimizerSpec, StateLayout
from zero3.partition.sharded_param import ShardedParam
from zero3.step.early_step import EarlySteps
from zero3.step.layout import ScalarSnapshot, SubGroup
from zero3.step.grad_shards import GradShards, Piece
from zero3.step.loss_scaler import DynamicLossScaler, LossScaler
from zero3.step_protocol import StepProtocol


class ReplicaVote(Protocol):
    """What the step asks of torchft's replicas (zero3.fault_tolerance.replica_step), where it runs with them."""

    def average(self, tensor: torch.Tensor) -> None:
        """The replica groups' average of `tensor`, in place."""
        ...

    def commit(self) -> bool:
        """The quorum's vote on this step (a recovering group takes its peer's state in it)."""
        ...

    def abandon(self) -> None:
        """The step raised on every rank of the group before its vote."""
        ...


NOT_APPLIED = " (the step was applied on no rank)"


@dataclass
class MasterSlots:
    """One parameter's optimizer-side shards: its fp32 master and its elementwise states ("moments")."""

    hp: Slot
    moments: dict[str, Slot]
    owner: "ZeroOptimizer"  # the optimizer that steps the parameter (zero3.accessors asks whether it has yet)


def _nothing() -> None:
    pass


# Each parameter's master slots, for the per-parameter accessors (zero3.safe_get_local_fp32_param, ...).
_MASTERS: weakref.WeakKeyDictionary[ShardedParam, MasterSlots] = weakref.WeakKeyDictionary()


def settle_for_accessor(sp: ShardedParam) -> None:
    """Before an accessor reads `sp`'s master or moments, or writes its gradient or master: the backward's
    early steps are undone (zero3.step.early_step), so it sees no speculated value."""
    slots = _MASTERS.get(sp)
    if slots is not None:
        slots.owner.before_state_change()  # (a write must not reach a save reading the state in place)
        slots.owner.undo_early_steps("an accessor read or wrote the optimizer's state")


def master_slots(sp: ShardedParam) -> MasterSlots | None:
    """The master and moments of `sp` in the optimizer that steps it; None if none does. For a reader
    outside the step (the accessors): settled first (`settle_for_accessor`)."""
    settle_for_accessor(sp)
    return _MASTERS.get(sp)


class ZeroOptimizer:
    """Steps this rank's shards. `param_groups` are torch's, so schedulers work."""

    def __init__(
        self,
        groups: list[tuple[list[ShardedParam], dict[str, Any]]],
        spec: OptimizerSpec,
        state_layout: StateLayout,
        comm: Communicator,
        device: torch.device,
        grads: GradShards,
        sub_group_size: int,
        gradient_clipping: float,
        loss_scaler: LossScaler | DynamicLossScaler,
        make_states: Callable[[tuple[str, ...], int, int], OptimizerStates],
        borrow_scratch: Callable[[int, torch.device], torch.Tensor | None] | None = None,
        matrix_bucket_numel: int = 500_000_000,
        ignore_unused_parameters: bool = True,
        masters_are_shards: bool = False,
        protocol: StepProtocol | None = None,
    ) -> None:
        self.comm = comm
        # The step's agreements (zero3.step_protocol): its own where no engine gave one.
        self.protocol = protocol if protocol is not None else StepProtocol(comm)
        self.device = device
        # DeepSpeed's zero_optimization.ignore_unused_parameters=false: a trained parameter without a
        # gradient on every rank is an error (zero3 otherwise steps it as torch does: not at all).
        self.ignore_unused_parameters = ignore_unused_parameters
        self.gradient_clipping = gradient_clipping
        self.loss_scaler = loss_scaler
        self.params = [sp for sps, _ in groups for sp in sps]
        total = sum(sp.shard_numel for sp in self.params)
        runs_by_group = [_split(sps, sub_group_size) for sps, _ in groups]
        largest = max((sum(piece.numel for piece in run) for runs in runs_by_group for run in runs), default=0)
        # (total elements, the largest sub-group): the tier sizes its buffers or windows from them.
        self.spec = spec
        self.state_names = state_layout.elementwise
        self.scalar_names = state_layout.scalars
        # One copy where the masters are the shards (see the Note): no hp_params buffer then.
        self.states = make_states((*(() if masters_are_shards else ("hp_params",)), *self.state_names), total, largest)
        self.largest_sub_group = largest
        # Set when a step failed on some rank after others had applied it in place: the ranks' states
        # differ, and the engine refuses to train on until a checkpoint is loaded.
        self.diverged: str | None = None
        self.hp_params: FlatBuffer | None = self.states.buffers.get("hp_params")
        self.moments = {name: self.states.buffers[name] for name in self.state_names}
        # The reduced gradients (the engine's, laid out in this optimizer's order): accumulated across
        # micro-steps in grad_accum_dtype; DeepSpeed's name `lp_grads` whatever that dtype is.
        if grads.params != self.params:
            raise ValueError("the gradient shards must be laid out in the optimizer's parameter order")
        self.grads = grads
        # The 16-bit shards could not all be written after a step: rewritten from the masters first thing.
        self.lp_stale = False
        self.lp_write_error: StepIOError | None = None
        self.last_overflow: torch.Tensor | None = None  # whether the last step's gradients were not finite

        self.sub_groups: list[SubGroup] = []
        self._masters_by_param: dict[ShardedParam, list[nn.Parameter]] = {}
        torch_groups: list[dict[str, Any]] = []
        # Each parameter's master and moments: this optimizer's own map (the parameter knows none of it).
        self.masters: dict[ShardedParam, MasterSlots] = {}
        # Each parameter's place in the optimizer order: in lp_grads, the moments, and hp_params if any.
        self.order_offsets: dict[ShardedParam, int] = {}
        cursor = 0
        for sp in self.params:
            assert sp.lp_slot is not None
            if masters_are_shards:
                _check_shard_is_master(sp, self.step_device)
            hp = (Slot(sp.lp_slot.buffer, sp.lp_slot.offset, sp.shard_numel) if self.hp_params is None
                  else Slot(self.hp_params, cursor, sp.shard_numel))
            slots = MasterSlots(hp, {name: Slot(buf, cursor, sp.shard_numel) for name, buf in self.moments.items()}, self)
            self.masters[sp] = slots
            self.order_offsets[sp] = cursor
            _MASTERS[sp] = slots
            if self.hp_params is not None:
                slots.hp.write(sp.hp_seed if sp.hp_seed is not None else sp.lp_slot.read())
                sp.followers.append(slots.hp)  # a new full value (GatheredParameters) reaches the master too
                sp.master_keeper = self
            sp.hp_seed = None
            cursor += sp.shard_numel
        for group_index, ((_, options), runs) in enumerate(zip(groups, runs_by_group)):
            group_masters: list[nn.Parameter] = []
            for run in runs:
                masters = [nn.Parameter(torch.empty(0, device=self.step_device)) for _ in run]
                for piece, master in zip(run, masters):
                    self._masters_by_param.setdefault(piece.sp, []).append(master)
                numel = sum(piece.numel for piece in run)
                sub = SubGroup(self.order_offsets[run[0].sp] + run[0].start, numel, run, masters, group_index,
                               bool(options.get("use_muon")))
                self.sub_groups.append(sub)
                group_masters.extend(masters)
            torch_groups.append({"params": group_masters, **options})

        # Torch's fused kernel where the class has one, on the host too (benchmarks/host_adam.py compares
        # it with foreach and DeepSpeedCPUAdam).
        self.optimizer, self.fused = optimizer_spec.build(spec, torch_groups)
        # Pieces whose state torch has not created yet (see the Note); adopted after their first step.
        self._fresh: set[nn.Parameter] = {master for sub in self.sub_groups for master in sub.masters}
        if state_layout.eager:
            # Made in the constructor, over the empty placeholders: filled here as the class fills them.
            for name, fill in state_layout.eager.items():
                self.moments[name].fill(fill)
            self._fresh.clear()
        # Steps skipped on the device (a non-finite gradient under a static loss scale), read only when asked.
        self.skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        # With fault_tolerance: the replicas' average and the step's commit vote go through torchft
        # (zero3.fault_tolerance.replicas' Note); `dropped` says the last step's vote was no.
        self.replica_step: ReplicaVote | None = None
        self.dropped = False
        self._views_bound = False  # the masters and moments view the buffers (see [Note: master views])
        # Called before anything here changes the masters, moments or 16-bit shards: an async save may be
        # reading them in place (zero3.checkpoint.shared_state); the engine sets it.
        self.before_state_change: Callable[[], None] = _nothing
        if not self.states.transactional:
            self.bind_views()
        # Lends idle scratch memory of at least n bytes on a device, or None (the engine's reduce
        # bucket, idle during the step).
        self.borrow_scratch = borrow_scratch
        self.exchange: MatrixExchange | None = None
        if spec.muon is not None:
            self._set_up_muon(groups, matrix_bucket_numel)
        self._lp_on_disk = False
        self.link_lp()
        self.grads_in_place = steps_on_its_gradients(grads, self.step_device, self.states.transactional,
                                                     muon=self.exchange is not None)
        # ZeRO-Offload's step begun during the backward (zero3.step.early_step), where the engine asks.
        self.early: EarlySteps | None = None

    def overlap_host_step(self, early: EarlySteps) -> None:
        """Step each sub-group on a host thread as its gradients land, by `early` (see zero3.step.early_step's
        Note); the engine's build makes it and wires the reducer's landings to it."""
        if self.exchange is not None:
            raise ValueError("offload_optimizer.super_offload steps each sub-group on its own as its gradients "
                             "land; Muon's step needs whole matrices across sub-groups: use one or the other")
        if self.states.transactional or self.step_device.type != "cpu":
            raise ValueError("the overlapped host step needs the optimizer state in host memory (offload_optimizer "
                             "device 'cpu')")
        self.early = early

    def undo_early_steps(self, why: str) -> None:
        """Put back what the backward's early steps changed (someone outside the step needs the state)."""
        if self.early is not None:
            self.early.undo(why)

    def link_lp(self) -> None:
        """Where the step writes each sub-group's new 16-bit shards: the parameters' slots now (none for a
        lean parameter: zero3.partition.lean's Note; a gather casts its master)."""
        if self.hp_params is not None:  # else the step writes no shards: they are the masters
            for sub in self.sub_groups:
                sub.lp_runs = _lp_runs(sub)
        self._lp_on_disk = any(sp.lp_slot is not None and sp.lp_slot.buffer.store is not None for sp in self.params)

    def _set_up_muon(self, groups: list[tuple[list[ShardedParam], dict[str, Any]]], bucket_numel: int) -> None:
        """The matrices' directions buffer, their exchange, and what MuonAdamW reads per piece."""
        assert isinstance(self.optimizer, MuonAdamW) and self.spec.muon is not None
        matrices = [sp for sps, options in groups if options.get("use_muon") for sp in sps]
        # split_groups puts the Muon groups first, so their masters are [0, total) of the flat buffers.
        total = sum(sp.shard_numel for sp in matrices)
        assert all(self.order_offsets[sp] < total for sp in matrices)
        self.muon_directions = torch.zeros(total, dtype=torch.float32, device=self.step_device)
        for sub in self.sub_groups:
            if sub.muon:
                for piece, master in zip(sub.pieces, sub.masters):
                    start = self.order_offsets[piece.sp] + piece.start
                    self.optimizer.updates[master] = self.muon_directions[start : start + piece.numel]
                    self.optimizer.shapes[master] = piece.sp.shape
        if not matrices:
            return
        mesh = matrices[0].mesh
        group = mesh.shard_group
        if self.step_device.type == "cpu" and dist.get_backend(group) != "gloo" and self.comm.topology is not None:
            group = self.comm.topology.host_shard_group  # host tensors (ZeRO-Offload beside a GPU) travel on gloo
        self.exchange = MatrixExchange(
            [Matrix(sp, sp.shape, sp.numel, sp.shard_numel, self.order_offsets[sp]) for sp in matrices],
            mesh.shard_rank, mesh.shard_size, group, bucket_numel, self.spec.muon,
        )

    def _orthogonalize_matrices(self, coefficient: torch.Tensor | None, idle: set[int], work: torch.Tensor) -> None:
        """Phases 1 and 2 of zero3.optim.muon's Note: this rank's shards of every stepped matrix's
        direction (the state only read), then the exchange that orthogonalizes them. A failure in the
        first phase still joins the exchange (its collectives pair with the other ranks'), then raises."""
        assert self.exchange is not None
        arrived = self.grads.arrived
        skip = {index for index, sub in enumerate(self.sub_groups) if not sub.muon} | idle

        def visit(index: int, window: dict[str, torch.Tensor]) -> None:
            sub = self.sub_groups[index]
            group = self.optimizer.param_groups[sub.group_index]
            grad = work[: sub.numel]
            self._fill_grad(sub, grad)
            if coefficient is not None:
                grad.mul_(coefficient)
            cursor = 0
            for piece, master in zip(sub.pieces, sub.masters):
                if arrived[piece.sp]:
                    piece_grad = grad[cursor : cursor + piece.numel]
                    # A piece torch has not stepped yet starts from a zero buffer (whatever the flat buffer holds).
                    buffer = (torch.zeros_like(piece_grad) if master in self._fresh
                              else window["exp_avg"][cursor : cursor + piece.numel])
                    self.muon_directions[sub.offset + cursor : sub.offset + cursor + piece.numel].copy_(
                        direction(piece_grad, buffer, group["momentum"], group["nesterov"]))
                cursor += piece.numel

        failure: Exception | None = None
        try:
            self.states.walk([(sub.offset, sub.numel) for sub in self.sub_groups], visit, skip, readonly=True)
        except Exception as error:  # noqa: BLE001 - raised below, once the exchange is done
            failure = error
        self.exchange.orthogonalize(self.muon_directions, {m.key for m in self.exchange.matrices if arrived[m.key]})
        if failure is not None:
            raise failure

    @property
    def masters_are_shards(self) -> bool:
        """Whether each master is its parameter's shard (see [Note: masters that are the shards])."""
        return self.hp_params is None

    @property
    def step_device(self) -> torch.device:
        """Where the step runs, as the optimizer-state tier declares it (the host for a disk tier)."""
        return self.states.step_device

    # [Note: master views]
    # Torch's optimizer holds tensors, not slots: each master is a view of
    # the sub-group's window of `hp_params` (or of its shard, where the
    # masters are the shards) and its moments are views of the moment
    # windows. Those views would pin the old storage when a state is
    # offloaded, so `unbind_views` drops them (the offload tier calls it
    # before moving `hp_params` or `optim_states`, or `lp_params` where it
    # holds the masters, and a disk tier's walk
    # after every step: its windows are reused) and each step binds them
    # again from the windows it is handed.
    @property
    def views_bound(self) -> bool:
        """Whether the masters and moments view the buffers now (see the Note)."""
        return self._views_bound

    def bind_views(self) -> None:
        for sub in self.sub_groups:
            self._bind(sub, {name: buffer.view(sub.offset, sub.numel) for name, buffer in self.states.buffers.items()})
        self._views_bound = True

    def _bind(self, sub: SubGroup, window: dict[str, torch.Tensor]) -> None:
        cursor = 0
        for piece, master in zip(sub.pieces, sub.masters):
            if self.hp_params is None:  # the master slot is the shard's (see [Note: masters that are the shards])
                hp = self.masters[piece.sp].hp
                master.data = hp.buffer.view(hp.offset + piece.start, piece.numel)
            else:
                master.data = window["hp_params"][cursor : cursor + piece.numel]
            state = self.optimizer.state[master]
            for name in self.state_names:
                if name in state:
                    state[name] = window[name][cursor : cursor + piece.numel]
            cursor += piece.numel

    def _adopt(self, sub: SubGroup, window: dict[str, torch.Tensor]) -> None:
        """Move the state torch created at a piece's first step into the flat buffers (see the Note)."""
        cursor = 0
        for piece, master in zip(sub.pieces, sub.masters):
            state = self.optimizer.state[master]
            if master in self._fresh and state:
                for name in self.state_names:
                    if name in state:
                        view = window[name][cursor : cursor + piece.numel]
                        view.copy_(state[name])
                        state[name] = view
                self._fresh.discard(master)
            cursor += piece.numel

    def unbind_views(self) -> None:
        self._views_bound = False
        for sub in self.sub_groups:
            for master in sub.masters:
                master.data = torch.empty(0, device=self.step_device)
                state = self.optimizer.state[master]
                for name in self.state_names:
                    if name in state:
                        state[name] = torch.empty(0, device=self.step_device)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    # ---- gradients -----------------------------------------------------------
    def zero_grad(self) -> None:
        self.undo_early_steps("zero_grad dropped the gradients")
        self.grads.zero()

    def agree_on_gradients(self, failed: bool = False) -> tuple[torch.Tensor, bool]:
        """The global squared grad norm (still loss-scaled; inf/nan on overflow), as a tensor on the
        device that nothing reads; which parameters got a gradient on ANY rank; and whether any rank
        `failed` getting ready to step.

        A parameter some rank did not use still has a gradient (zero there, the
        others' elsewhere), and each rank steps only its own shard of it: all
        ranks must step it, or none, or one parameter's shards drift apart. The
        flags are host booleans, agreed on the gloo control group, so reading
        them never waits on the accelerator (see [Note: a step without host syncs]).
        """
        if self.replica_step is not None:
            self.grads.sum_whole(self.replica_step.average)  # torchft's replicas (zero3.fault_tolerance)
        elif self.comm.has_replicas:
            self.grads.sum_whole(self.comm.all_reduce_replicas)  # see the Note there
        squared = self.comm.all_reduce_sum(self.grads.squared_norm().reshape(1).to(self.device))
        if self.comm.job_alone:
            return squared[0], failed  # nothing to agree with: this rank's flags are everyone's
        arrived = self.grads.arrived
        agreed = self.protocol.flags([arrived[sp] for sp in self.params] + [failed])
        for sp, flag in zip(self.params, agreed):
            arrived[sp] = flag
        return squared[0], agreed[-1]

    # ---- step ------------------------------------------------------------------
    # [Note: a step on every rank or on none]
    # Each rank steps its own shards, so a step that lands on some ranks and not
    # on others leaves every parameter's shards from two different steps. So a
    # step is agreed twice, on host flags of the gloo control group:
    # * before anything changes: what can fail without changing state (the
    #   16-bit repair, the step's working memory, Muon's read-only phase) runs
    #   first, and its outcome rides on the gradient flags the step agrees
    #   anyway (`agree_on_gradients`; Muon adds one flag round after its
    #   exchange). If any rank failed, every rank raises and none has stepped.
    # * after the walk: one flag round. A disk tier's walk only wrote the next
    #   generation (zero3.offload.optimizer_tier), so it is committed when every
    #   rank's walk succeeded and abandoned on every rank otherwise (the step
    #   counts and 16-bit shards put back): a failing disk on one rank is a
    #   step applied nowhere. A memory tier steps in place, with nothing left
    #   that allocates (the working memory is taken before the first
    #   agreement); if one rank's update still fails, the others have applied
    #   it: every rank raises, says so, and the engine refuses to train on
    #   (`diverged`) until a checkpoint is loaded. A failed write of the 16-bit
    #   shards after a landed step is every rank's StepIOError(step_applied=True).
    # A rank that failed still joins every collective of the step in order, so
    # no rank waits on one that left.
    def step(self) -> tuple[bool, torch.Tensor]:
        """Unscale, clip and step. Returns (stepped, grad_norm); skips on overflow (see the Note:
        `stepped` is False only for a dynamic loss scale's skip; other skips are counted in `skipped`).

        If any rank fails, every rank raises (see [Note: a step on every rank or on
        none]); a failed disk tier leaves the state as it was before the step and
        keeps the gradients, so the step can be retried (StepIOError(step_applied=False)).
        """
        self.before_state_change()
        failure: BaseException | None = None
        work: torch.Tensor | None = None
        self.dropped = False
        repairing = self.lp_stale  # the same on every rank (see repair_lp)
        if self.lp_stale:  # the repair below writes the shards from the masters as they are: not speculated
            self.undo_early_steps("the 16-bit shards are rewritten from the masters")
        early = self.early if self.early is not None and self.early.armed else None
        if early is not None:
            failure = early.wait()  # an early step that raised is this rank's failed step
        try:
            self.repair_lp()
            # The walk's fp32 gradients, for its largest sub-group: taken before the ranks agree, so that an
            # out-of-memory here is a step no rank applies.
            work = self._in_place_grads() if self.grads_in_place else self._fp32_grads(self.largest_sub_group, self.step_device)
        except Exception as error:  # noqa: BLE001 - every rank raises it, below
            failure = failure or error
        scale = self.loss_scaler.loss_scale
        squared, any_failed = self.agree_on_gradients(failed=failure is not None)
        if any_failed:
            self.lp_stale = repairing  # kept alike on every rank
            self.undo_early_steps("a rank failed before its step")
            if self.replica_step is not None:
                self.replica_step.abandon()
            self.protocol.fail_together("step", failure, NOT_APPLIED)
        assert work is not None
        if not self.ignore_unused_parameters:
            unused = [sp.name for sp in self.params if not self.grads.arrived[sp]]  # agreed: alike everywhere
            if unused:
                self.undo_early_steps("a parameter got no gradient")
                if self.replica_step is not None:
                    self.replica_step.abandon()
                raise RuntimeError(
                    f"{len(unused)} trained parameters got no gradient on any rank in this step "
                    f"({', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''}) and "
                    "zero_optimization.ignore_unused_parameters is false; the step was applied on no rank "
                    "(set it to true to step only the parameters that have gradients, as torch does)"
                )
        # The fault-tolerant quorum's commit point (zero3.fault_tolerance.replicas' Note): alike on every
        # rank of the group, before anything changes. A recovering group takes its peer's state in it.
        if self.replica_step is not None and not self.replica_step.commit():
            self.dropped = True
            self.zero_grad()
            return False, squared.sqrt() / scale
        if self.replica_step is not None:
            scale = self.loss_scaler.loss_scale  # a recovery brings the peer's (its gradients are scaled by it)
        scaler_before = self.loss_scaler.state_dict()
        norm = squared.sqrt() / scale
        overflow = ~torch.isfinite(squared)
        self.last_overflow = overflow  # a device bool: was_step_applied reads it when asked
        found_inf: torch.Tensor | None = None
        if self.loss_scaler.dynamic:
            # The one host read a step makes: the dynamic scale's next value depends on it.
            overflowed = bool(overflow.item())
            self.loss_scaler.update(overflowed)
            if overflowed:
                self.zero_grad()  # (which undoes the early steps)
                return False, norm
        elif self.fused:
            # A non-finite gradient skips the update in the fused kernel itself (masters, moments and
            # step counts unchanged), decided on the device; `skipped` counts it there.
            found_inf = overflow.to(torch.float32)
            self.skipped.add_(overflow)
        elif bool(overflow.item()):
            # Without a fused kernel the skip is decided on the host: one read of the device per step.
            self.skipped.add_(1)
            self.zero_grad()
            return True, norm
        # Why the backward's early steps are not this step's operation, if they are not (one host read). Asked
        # at every step of an overlapped host step, armed or not: the next backward speculates only after a
        # step whose values would have kept it (zero3.step.early_step's Note).
        judged = self.early is not None
        why_not: str | None = None
        if judged and found_inf is not None and bool(overflow.item()):
            why_not = "a gradient is not finite"
        coefficient: torch.Tensor | None = None
        if self.gradient_clipping > 0:
            coefficient = (self.gradient_clipping / (norm + 1e-6)).clamp_(max=1.0)
            if judged and why_not is None and bool(coefficient != 1.0):
                why_not = "the gradients are clipped"  # (x * 1 is x: unclipped, the early steps made this step)
            if scale != 1.0:
                coefficient.mul_(1.0 / scale)
        elif scale != 1.0:
            coefficient = torch.full((), 1.0 / scale, dtype=torch.float32, device=norm.device)
        if self.early is not None:  # (judged)
            self.early.values_refused(why_not)
        # Once, where the step runs: a host step (ZeRO-Offload beside a GPU) waits for the values, as it must.
        if coefficient is not None:
            coefficient = coefficient.to(self.step_device)
        if found_inf is not None:
            found_inf = found_inf.to(self.step_device)

        def put_back() -> None:
            """The loss scale and the skip count as before this step (it is not applied after all)."""
            self.loss_scaler.load_state_dict(scaler_before)
            if found_inf is not None:
                self.skipped.sub_(overflow.to(self.skipped.dtype))  # what the fused path added above

        arrived = self.grads.arrived
        idle = {i for i, sub in enumerate(self.sub_groups) if not any(arrived[piece.sp] for piece in sub.pieces)}
        # The sub-groups the backward stepped early, kept where they made this step's operation (see
        # zero3.step.early_step's Note); else undone, and stepped below with the rest.
        stepped_early = early.keep_or_undo(why_not) if early is not None else set()
        if self.exchange is not None:
            try:
                self._orthogonalize_matrices(coefficient, idle, work)
            except Exception as error:  # noqa: BLE001 - every rank raises it, below
                failure = error
            self.protocol.settle("step", failure, NOT_APPLIED, undo=put_back)
        streamed = self.states.transactional
        # The scalars to put back if the walk fails on some rank: only a transactional tier's step can be
        # abandoned; a memory tier's failed walk leaves the engine refusing to train until a checkpoint is
        # loaded (see the Note), which brings every scalar back.
        before = self.scalar_snapshot() if streamed else None
        # A sub-group's new shards are written as soon as it has stepped (on a GPU they copy while the
        # next one steps), except into a disk file beside masters kept in memory: those masters are
        # updated in place, so the shards go after the whole walk.
        during = streamed or not self._lp_on_disk

        def visit(index: int, window: dict[str, torch.Tensor]) -> None:
            sub = self.sub_groups[index]
            grad = self._in_place_window(work, sub) if self.grads_in_place else work[: sub.numel]
            self.step_sub_group(sub, window, coefficient, found_inf, grad, fill_grad=not self.grads_in_place)
            if during and self.hp_params is not None:
                self._write_lp(sub, window["hp_params"])

        lp_failure: OSError | None = None
        try:
            if during and self.hp_params is not None:
                for index in sorted(stepped_early):
                    self._write_lp(self.sub_groups[index], self.hp_params.view(self.sub_groups[index].offset,
                                                                             self.sub_groups[index].numel))
            self.states.walk([(sub.offset, sub.numel) for sub in self.sub_groups], visit, idle | stepped_early)
            if not during and self.hp_params is not None:
                try:
                    for index, sub in enumerate(self.sub_groups):
                        if index not in idle:
                            self._write_lp(sub, self.hp_params.view(sub.offset, sub.numel))
                except OSError as error:
                    lp_failure = error
        except Exception as error:  # noqa: BLE001 - every rank raises it, below
            failure = error
        finally:
            if streamed:
                self.unbind_views()  # the windows are reused: no view of them may outlive the walk
        any_failed, any_lp_failed = self.protocol.flags([failure is not None, lp_failure is not None])
        if any_failed:
            self._abandon(before, put_back, streamed)
            if streamed:
                self.protocol.fail_together("step", failure, NOT_APPLIED)
            self.diverged = (
                "an optimizer step failed on one rank after the others had applied it in place, so the ranks' "
                "shards are now from different steps; load the last checkpoint (engine.load_checkpoint) "
                "before training on"
            )
            self.protocol.fail_together("step", failure, f" ({self.diverged})")
        self.states.commit()
        self.lp_write_error = None
        if any_lp_failed:
            # The step landed everywhere; the shards are rewritten from it before the next use, and the
            # engine reports the failure on every rank once its own bookkeeping of the step is done.
            self.lp_stale = True  # on every rank, so they repair together (a rewrite where none failed)
            own = None if lp_failure is None else StepIOError(
                f"the optimizer step was applied, but writing the new 16-bit parameters to disk failed: "
                f"{lp_failure}. Nothing is lost: they are rewritten from the fp32 masters before the next "
                "forward. Do not repeat the step.",
                step_applied=True,
            )
            peer = self.protocol.peer_failure("step", own)
            self.lp_write_error = own if own is not None else peer  # type: ignore[assignment]
        self.zero_grad()
        return True, norm

    def join_as_failed(self, failure: BaseException) -> None:
        """This rank failed before its step while the others are in theirs: make this rank's part of
        the step's first agreement as a rank that failed, so every other rank raises `failure`."""
        self.agree_on_gradients(failed=True)
        self.protocol.peer_failure("step", failure)

    def _abandon(self, before: ScalarSnapshot | None, put_back: Callable[[], None],
                 streamed: bool) -> None:
        """After a walk that failed on some rank: what the step changed here, put back where it can be."""
        if before is not None:
            self.restore_scalars(before)
        put_back()
        if streamed:
            self.states.abandon()
            # Shards were written from masters that did not land: back to the old masters' values now, or,
            # where a disk still fails, on every rank before the next use (lp_stale stays alike everywhere).
            self.lp_stale = True
            failed = False
            try:
                self.repair_lp()
            except OSError:
                failed = True
            self.lp_stale = self.protocol.flags([failed])[0]

    def _fill_grad(self, sub: SubGroup, grad: torch.Tensor) -> None:
        """The sub-group's reduced gradients into `grad` (its dtype: the step's fp32)."""
        self.grads.copy_range(sub.offset, sub.pieces, grad)

    def _in_place_grads(self) -> torch.Tensor:
        """The reduced gradients the step runs on in place (`grads_in_place`): the flat buffer, or an empty
        tensor where each shard is a tensor of its own (each sub-group then takes its pieces' views)."""
        if self.grads.buffer is None:
            return torch.empty(0, device=self.step_device)
        return self.grads.buffer.tensor

    def _in_place_window(self, work: torch.Tensor, sub: SubGroup) -> torch.Tensor | None:
        """A sub-group's gradients to step in place: its window of the flat buffer, or None (own shards)."""
        return work.narrow(0, sub.offset, sub.numel) if self.grads.buffer is not None else None

    def step_sub_group(
        self, sub: SubGroup, window: dict[str, torch.Tensor], coefficient: torch.Tensor | None,
        found_inf: torch.Tensor | None, grad: torch.Tensor | None, fill_grad: bool,
    ) -> None:
        """Step one sub-group's window from `grad` (`fill_grad`: copied there from lp_grads first; None: in
        place, on the views of its pieces' own gradient shards)."""
        # This sub-group's fp32 gradients, made in `grad` from the 16-bit ones (never stored): the step's
        # working memory, the idle reduce bucket when it is large enough (a fresh buffer page-faults); or,
        # with `grads_in_place`, `grad` is the reduced gradients themselves.
        arrived = self.grads.arrived
        if grad is None:
            piece_grads: list[torch.Tensor | None] = [
                self.grads.view(piece.sp)[piece.start : piece.start + piece.numel] if arrived[piece.sp] else None
                for piece in sub.pieces]
            if coefficient is not None:
                present = [piece_grad for piece_grad in piece_grads if piece_grad is not None]
                if present:
                    torch._foreach_mul_(present, coefficient)
        else:
            if fill_grad:
                self._fill_grad(sub, grad)
            if coefficient is not None:
                grad.mul_(coefficient)
            piece_grads = list(grad.split(sub.piece_numels))
        if not self._views_bound:
            self._bind(sub, window)
        for piece, master, piece_grad in zip(sub.pieces, sub.masters, piece_grads):
            master.grad = piece_grad if arrived[piece.sp] else None
        if self.fused:
            self.optimizer.found_inf = found_inf  # read by torch's fused kernels only
        try:
            self.optimizer.step()
        finally:
            for master in sub.masters:  # (torch steps every parameter with a .grad: none may stay set)
                master.grad = None
        if self._fresh:
            self._adopt(sub, window)

    # ---- per-parameter state (checkpoints) -------------------------------------------
    def has_state(self, sp: ShardedParam) -> bool:
        """Whether torch has created this parameter's optimizer state (it has been stepped)."""
        return bool(self.optimizer.state[self._masters_by_param[sp][0]])

    def scalar_state(self, sp: ShardedParam) -> dict[str, torch.Tensor]:
        """The parameter's scalar state (Adam: its step count), as tensors; every piece holds the same."""
        state = self.optimizer.state[self._masters_by_param[sp][0]]
        return {name: torch.as_tensor(state[name]).detach().clone() for name in self.scalar_names if name in state}

    def set_states(self, scalars_by_param: Mapping[ShardedParam, dict[str, torch.Tensor] | None]) -> None:
        """Mark each parameter stepped with its scalars (its elementwise states were written into the
        buffers), or, with None, never stepped (torch creates its state at its next step); the views are
        bound once for all (a load sets every parameter)."""
        self.before_state_change()
        for sp, scalars in scalars_by_param.items():
            for master in self._masters_by_param[sp]:
                state = self.optimizer.state[master]
                state.clear()
                if scalars is None:
                    self._fresh.add(master)
                    continue
                self._fresh.discard(master)
                for name, value in scalars.items():
                    state[name] = value.to(device=self.step_device).clone()
                for name in self.state_names:
                    state[name] = torch.empty(0, device=self.step_device)  # bound to the buffers below
        if self._views_bound:
            self.bind_views()

    def read_client_state(self, client: torch.optim.Optimizer) -> None:
        """Take over the state a client optimizer already has for its parameters: this rank's shard of
        each elementwise state, and the scalars."""
        self.before_state_change()
        stepped: dict[ShardedParam, dict[str, torch.Tensor] | None] = {}
        for sp in self.params:
            state = client.state.get(sp.param)
            if not state:
                continue
            missing = [name for name in self.state_names if not isinstance(state.get(name), torch.Tensor)]
            if missing:
                raise ValueError(
                    f"the client optimizer's state for {sp.name} lacks {missing} (it has {sorted(state)})"
                )
            slots = self.masters[sp]
            for name in self.state_names:
                full = state[name].detach()
                if full.numel() != sp.numel:
                    raise ValueError(
                        f"the client optimizer's {name!r} for {sp.name} has {full.numel()} elements, "
                        f"the parameter {sp.numel}"
                    )
                slots.moments[name].write(sp.shard_of(full.to(dtype=torch.float32, device="cpu")))
            stepped[sp] = {name: torch.as_tensor(state[name]) for name in self.scalar_names if name in state}
        self.set_states(stepped)

    def scalar_snapshot(self) -> ScalarSnapshot:
        """Every piece's scalar state (and whether it has any) before a step, to put back if the step fails
        on some rank (a transactional tier's) or its early part is undone (zero3.step.early_step). The
        0-dim tensors of one name (Adam's step counts) are copied in one `stack`, not one clone per piece:
        this runs at every such step."""
        fresh: list[nn.Parameter] = []
        tensors: dict[str, tuple[list[nn.Parameter], list[torch.Tensor]]] = {name: ([], []) for name in self.scalar_names}
        loose: list[tuple[nn.Parameter, str, Any]] = []
        for sub in self.sub_groups:
            for master in sub.masters:
                if master in self._fresh:
                    fresh.append(master)
                    continue
                state = self.optimizer.state[master]
                for name in self.scalar_names:
                    if name not in state:
                        continue
                    value = state[name]
                    if isinstance(value, torch.Tensor) and value.dim() == 0:
                        tensors[name][0].append(master)
                        tensors[name][1].append(value)
                    else:
                        loose.append((master, name, value.clone() if isinstance(value, torch.Tensor) else value))
        stacked: dict[str, tuple[list[nn.Parameter], torch.Tensor]] = {}
        for name, (masters, values) in tensors.items():
            if not values:
                continue
            if len({(value.device, value.dtype) for value in values}) == 1:
                stacked[name] = (masters, torch.stack(values))
            else:
                loose.extend((master, name, value.clone()) for master, value in zip(masters, values))
        return ScalarSnapshot(fresh, stacked, loose)

    def restore_scalars(self, snapshot: ScalarSnapshot) -> None:
        """After a failed walk: every piece's scalars (and whether it had state) as before the step."""
        for master in snapshot.fresh:
            self.optimizer.state[master].clear()
            self._fresh.add(master)
        for name, (masters, values) in snapshot.stacked.items():
            for master, value in zip(masters, values.unbind()):
                self.optimizer.state[master][name] = value.clone()  # its own storage, as torch made it
        for master, name, value in snapshot.loose:
            self.optimizer.state[master][name] = value

    def _fp32_grads(self, numel: int, device: torch.device) -> torch.Tensor:
        borrowed = self.borrow_scratch(numel * 4, device) if self.borrow_scratch is not None else None
        if borrowed is not None:
            return borrowed.view(torch.float32)[:numel]
        return torch.empty(numel, dtype=torch.float32, device=device)

    def _write_lp(self, sub: SubGroup, hp: torch.Tensor) -> None:
        """The sub-group's new 16-bit shards, cast from its masters, wherever the shards live: one write
        per run of pieces that lie end to end in one shard buffer (usually a unit's whole run)."""
        for buffer, lp_offset, cursor, numel in sub.lp_runs:
            buffer.write_range(lp_offset, hp[cursor : cursor + numel])

    def repair_lp(self) -> None:
        """After a step whose 16-bit shards were not all written: write them again from the masters."""
        if not self.lp_stale:
            return
        self.before_state_change()
        if self.hp_params is None:  # the masters are the shards: nothing can lag behind them
            self.lp_stale = False
            return
        for sub in self.sub_groups:
            self._write_lp(sub, self.hp_params.read_range(sub.offset, sub.numel))
        self.lp_stale = False

    # ---- DeepSpeed's names, for code written against its stage-3 optimizer ----------------------
    @property
    def grad_partitions_flat_buffer(self) -> torch.Tensor:
        """This rank's gradient shards as one flat tensor, DeepSpeed's `grad_partitions_flat_buffer`: the live
        buffer where they have one; where they are made on demand, a copy of those held, zeros elsewhere
        (between steps: all zeros, as they hold no memory then)."""
        return self.grads.flat()

    @property
    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """DeepSpeed's `averaged_gradients`: from a backward to the step, each sub-group's gradient shards (this
        rank's, reduced across the ranks), one per piece of a parameter it steps, in lp_grads' dtype; empty
        where no gradient has arrived since the last step. Views where the shards are held; zeros otherwise."""
        if not self.grads.any_arrived():
            return {}
        return {index: [self.grads.read(piece.sp)[piece.start : piece.start + piece.numel] for piece in sub.pieces]
                for index, sub in enumerate(self.sub_groups)}

    def get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
        """DeepSpeed's `get_fp32_grad_partitions()`: `averaged_gradients` as {sub-group: {piece: its fp32 values}}
        (the same tensors where lp_grads is fp32)."""
        return {index: {i: grad.float() for i, grad in enumerate(grads)}
                for index, grads in self.averaged_gradients.items()}

    def close(self) -> None:
        """Free the tier's buffers and forget the parameters (the engine is being destroyed)."""
        if self.early is not None:
            self.early.close()
            self.early = None
        self.states.close()
        self.optimizer.state.clear()
        self.optimizer.param_groups.clear()
        self.sub_groups.clear()
        self.params.clear()
        for sp, slots in self.masters.items():
            if _MASTERS.get(sp) is slots:
                del _MASTERS[sp]
            if slots.hp in sp.followers:
                sp.followers.remove(slots.hp)
            if sp.master_keeper is self:
                sp.master_keeper = None
        self.masters.clear()

    def state_bytes(self) -> dict[str, int]:
        return {
            "hp_params": self.hp_params.nbytes if self.hp_params is not None else 0,
            "lp_grads": self.grads.nbytes,
            "optim_states": sum(buf.nbytes for buf in self.moments.values()),
        }


def steps_on_its_gradients(grads: GradShards, step_device: torch.device, transactional: bool, muon: bool) -> bool:
    """Whether the step runs on views of the reduced gradients `grads`, scaled in place (zero_grad clears them
    after the step), instead of on an fp32 copy of each sub-group's: where they are fp32 in one flat buffer on
    the step's device. Not where a failed step can be retried (a transactional tier keeps the gradients for
    it) or Muon's exchange reads them."""
    return grads.steps_in_place(step_device) and not transactional and not muon


def _check_shard_is_master(sp: ShardedParam, step_device: torch.device) -> None:
    """A shard that is to serve as its fp32 master must be one in memory where the step runs."""
    buffer = sp.lp_slot.buffer  # type: ignore[union-attr]
    if buffer.dtype != torch.float32 or buffer.store is not None or buffer.device != step_device:
        raise ValueError(
            f"the fp32 masters cannot be the shards: {sp.name}'s shard is {buffer.dtype} in {buffer.home} "
            f"memory, the step runs in fp32 on {step_device}"
        )


def _lp_runs(sub: SubGroup) -> list[tuple[FlatBuffer, int, int, int]]:
    """(shard buffer, offset in it, offset in the sub-group, elements) for each run of the sub-group's
    pieces that are contiguous in one 16-bit shard buffer (shard slots never move); a lean piece has none."""
    merged: list[tuple[FlatBuffer, int, int, int]] = []
    cursor = 0
    for piece in sub.pieces:
        lp = piece.sp.lp_slot
        if lp is None:
            cursor += piece.numel
            continue
        start = lp.offset + piece.start
        if merged and merged[-1][0] is lp.buffer and merged[-1][1] + merged[-1][3] == start:
            buffer, offset, first, numel = merged[-1]
            merged[-1] = (buffer, offset, first, numel + piece.numel)
        else:
            merged.append((lp.buffer, start, cursor, piece.numel))
        cursor += piece.numel
    return merged


def _split(sps: list[ShardedParam], limit: int) -> list[list[Piece]]:
    """Cut the shards' concatenation into runs of `limit` elements (the last shorter); see the Note."""
    runs: list[list[Piece]] = []
    current: list[Piece] = []
    room = limit
    for sp in sps:
        start = 0
        while start < sp.shard_numel:
            take = min(room, sp.shard_numel - start)
            current.append(Piece(sp, start, take))
            start += take
            room -= take
            if room == 0:
                runs.append(current)
                current, room = [], limit
    if current:
        runs.append(current)
    return runs
