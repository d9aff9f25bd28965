"""The sharded optimizer: fp32 master shards, flat optimizer states, clipping, loss scaling.

The layout it steps is zero3.step.layout's ([Note: optimizer layout]); torch's view of it,
zero3.step.torch_state's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from zero3.comm import Communicator
from zero3.offload.disk import StepIOError
from zero3.offload.optimizer_tier import OptimizerStates
from zero3.partition.flat_buffer import FlatBuffer, Slot
from zero3.optim import spec as optimizer_spec
from zero3.optim.muon import MatrixExchange, MuonAdamW
from zero3.optim.spec import OptimizerSpec, StateLayout
from zero3.partition.sharded_param import ShardedParam
from zero3.step.deepspeed_names import DeepSpeedOptimizerNames
from zero3.step.early_step import EarlySteps
from zero3.step.torch_state import TorchOptimizerState
from zero3.step.layout import ScalarSnapshot, SubGroup, check_shard_is_master, lp_runs, split, steps_on_its_gradients
from zero3.step.grad_shards import GradShards, Piece
from zero3.step.masters import MasterSlots
from zero3.step.replica_vote import ReplicaVote
from zero3.step.muon_step import MuonDirections
from zero3.step.step_plan import StepPlan
from zero3.step.loss_scaler import DynamicLossScaler, LossScaler
from zero3.step_protocol import StepProtocol


NOT_APPLIED = " (the step was applied on no rank)"


def _nothing() -> None:
    pass


class ZeroOptimizer(DeepSpeedOptimizerNames):
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
        runs_by_group = [split(sps, sub_group_size) for sps, _ in groups]
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
        self.grad_norm: torch.Tensor | None = None  # the last step's global norm, unscaled, before clipping

        self.sub_groups: list[SubGroup] = []
        torch_groups: list[dict[str, Any]] = []
        # Each parameter's master and moments: this optimizer's own map (the parameter knows none of it).
        self.masters: dict[ShardedParam, MasterSlots] = {}
        # Each parameter's place in the optimizer order: in lp_grads, the moments, and hp_params if any.
        self.order_offsets: dict[ShardedParam, int] = {}
        cursor = 0
        for sp in self.params:
            assert sp.lp_slot is not None
            if masters_are_shards:
                check_shard_is_master(sp, self.step_device)
            hp = (Slot(sp.lp_slot.buffer, sp.lp_slot.offset, sp.shard_numel) if self.hp_params is None
                  else Slot(self.hp_params, cursor, sp.shard_numel))
            slots = MasterSlots(hp, {name: Slot(buf, cursor, sp.shard_numel) for name, buf in self.moments.items()}, self)
            self.masters[sp] = slots
            self.order_offsets[sp] = cursor
            sp.master_slots = slots  # the parameter's own (zero3.step.masters)
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
                numel = sum(piece.numel for piece in run)
                sub = SubGroup(self.order_offsets[run[0].sp] + run[0].start, numel, run, masters, group_index,
                               bool(options.get("use_muon")))
                self.sub_groups.append(sub)
                group_masters.extend(masters)
            torch_groups.append({"params": group_masters, **options})

        # Torch's fused kernel where the class has one, on the host too (benchmarks/host_adam.py compares
        # it with foreach and DeepSpeedCPUAdam).
        self.optimizer, self.fused = optimizer_spec.build(spec, torch_groups)
        # Torch's masters and their state, bound to the buffers (zero3.step.torch_state).
        self.torch_state = TorchOptimizerState(self.optimizer, self.sub_groups, self.state_names, self.scalar_names,
                                               self.step_device, self._shard_master if masters_are_shards else None)
        if state_layout.eager:
            # Made in the constructor, over the empty placeholders: filled here as the class fills them.
            for name, fill in state_layout.eager.items():
                self.moments[name].fill(fill)
            self.torch_state.fresh.clear()
        # Steps skipped on the device (a non-finite gradient under a static loss scale), read only when asked.
        self.skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        # With fault_tolerance: the replicas' average and the step's commit vote go through torchft
        # (zero3.fault_tolerance.replicas' Note); `dropped` says the last step's vote was no.
        self.replica_step: ReplicaVote | None = None
        self.dropped = False
        # Called before anything here changes the masters, moments or 16-bit shards: an async save may be
        # reading them in place (zero3.checkpoint.shared_state); the engine sets it.
        self.before_state_change: Callable[[], None] = _nothing
        if not self.states.transactional:
            self.bind_views()
        # Lends idle scratch memory of at least n bytes on a device, or None (the engine's reduce
        # bucket, idle during the step).
        self.borrow_scratch = borrow_scratch
        # Muon's directions and their exchange across the shard group (zero3.step.muon_step), where it steps.
        self.muon: MuonDirections | None = None
        if spec.muon is not None:
            assert isinstance(self.optimizer, MuonAdamW)
            self.muon = MuonDirections(self.optimizer, groups, self.sub_groups, self.order_offsets, spec.muon,
                                       self.step_device, self.comm, matrix_bucket_numel)
        self.exchange: MatrixExchange | None = self.muon.exchange if self.muon is not None else None
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
                sub.lp_runs = lp_runs(sub)
        self._lp_on_disk = any(sp.lp_slot is not None and sp.lp_slot.buffer.store is not None for sp in self.params)

    def _shard_master(self, piece: Piece) -> torch.Tensor:
        """A piece's master where the masters are the shards: a view of its shard slot."""
        hp = self.masters[piece.sp].hp
        return hp.buffer.view(hp.offset + piece.start, piece.numel)

    @property
    def masters_are_shards(self) -> bool:
        """Whether each master is its parameter's shard (zero3.step.layout's [Note: masters that are the shards])."""
        return self.hp_params is None

    @property
    def step_device(self) -> torch.device:
        """Where the step runs, as the optimizer-state tier declares it (the host for a disk tier)."""
        return self.states.step_device

    @property
    def views_bound(self) -> bool:
        """Whether the masters and moments view the buffers now (zero3.step.torch_state's [Note: master views])."""
        return self.torch_state.views_bound

    def bind_views(self) -> None:
        self.torch_state.bind_views(self.states.buffers)

    def unbind_views(self) -> None:
        self.torch_state.unbind_views()

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
    # ---- the agreed step: its phases and why, in zero3.step.step_plan's [Note: a step on every rank or on none]
    def step(self) -> tuple[bool, torch.Tensor]:
        """Unscale, clip and step. Returns (stepped, grad_norm); skips on overflow (see the Note:
        `stepped` is False only for a dynamic loss scale's skip; other skips are counted in `skipped`).
        The norm is kept as `grad_norm` (unscaled, before clipping) until the next step.

        If any rank fails, every rank raises (see [Note: a step on every rank or on
        none]); a failed disk tier leaves the state as it was before the step and
        keeps the gradients, so the step can be retried (StepIOError(step_applied=False)).
        """
        stepped, self.grad_norm = self._agreed_step()
        return stepped, self.grad_norm

    def _agreed_step(self) -> tuple[bool, torch.Tensor]:
        """The step in its phases (the Note above): what can fail without changing state, agreed; the
        torchft commit; the scale, skip and clipping decided; the walk, agreed, committed or abandoned."""
        plan = self._prepare_step()
        squared = self._agree_before_changing(plan)
        # The fault-tolerant quorum's commit point (zero3.fault_tolerance.replicas' Note): alike on every
        # rank of the group, before anything changes. A recovering group takes its peer's state in it.
        if self.replica_step is not None and not self.replica_step.commit():
            self.dropped = True
            self.zero_grad()
            return False, squared.sqrt() / plan.scale
        if self.replica_step is not None:
            plan.scale = self.loss_scaler.loss_scale  # a recovery brings the peer's (its gradients are scaled by it)
        norm = squared.sqrt() / plan.scale
        skipped = self._unscale_and_clip(plan, squared, norm)
        if skipped is not None:
            return skipped
        self._walk(plan)
        self.zero_grad()
        return True, norm

    def _prepare_step(self) -> StepPlan:
        """What can fail before the step changes anything: the early step's outcome, the 16-bit repair, the
        walk's working memory (taken before the ranks agree, so that an out-of-memory is a step no rank
        applies)."""
        self.before_state_change()
        self.dropped = False
        plan = StepPlan(repairing=self.lp_stale, scale=self.loss_scaler.loss_scale)  # lp_stale: alike everywhere
        if self.lp_stale:  # the repair below writes the shards from the masters as they are: not speculated
            self.undo_early_steps("the 16-bit shards are rewritten from the masters")
        plan.early = self.early if self.early is not None and self.early.armed else None
        if plan.early is not None:
            plan.failure = plan.early.wait()  # an early step that raised is this rank's failed step
        try:
            self.repair_lp()
            plan.work = self.grads.in_place(self.step_device) if self.grads_in_place else \
                self._fp32_grads(self.largest_sub_group, self.step_device)
        except Exception as error:  # noqa: BLE001 - every rank raises it, in _agree_before_changing
            plan.failure = plan.failure or error
        return plan

    def _agree_before_changing(self, plan: StepPlan) -> torch.Tensor:
        """The first agreement: the gradients' squared norm (returned) and every rank's outcome so far; raises
        on every rank if any failed, or if a trained parameter got no gradient anywhere (unless allowed)."""
        squared, any_failed = self.agree_on_gradients(failed=plan.failure is not None)
        if any_failed:
            self.lp_stale = plan.repairing  # kept alike on every rank
            self.undo_early_steps("a rank failed before its step")
            if self.replica_step is not None:
                self.replica_step.abandon()
            self.protocol.fail_together("step", plan.failure, NOT_APPLIED)
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
        return squared

    def _unscale_and_clip(self, plan: StepPlan, squared: torch.Tensor,
                          norm: torch.Tensor) -> tuple[bool, torch.Tensor] | None:
        """The loss scale's update and the skip on a non-finite gradient, the clipping coefficient (unscaling
        folded in), and whether the backward's early steps made this step. Returns the step's outcome where
        it is skipped here, else None."""
        scale = plan.scale
        plan.scaler_before = self.loss_scaler.state_dict()
        overflow = ~torch.isfinite(squared)
        self.last_overflow = overflow  # a device bool: was_step_applied reads it when asked
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
            plan.found_inf = overflow.to(torch.float32)
            self.skipped.add_(overflow)
            plan.skip_counted = overflow
        elif bool(overflow.item()):
            # Without a fused kernel the skip is decided on the host: one read of the device per step.
            self.skipped.add_(1)
            self.zero_grad()
            return True, norm
        # Why the backward's early steps are not this step's operation, if they are not (one host read). Asked
        # at every step of an overlapped host step, armed or not: the next backward speculates only after a
        # step whose values would have kept it (zero3.step.early_step's Note).
        judged = self.early is not None
        if judged and plan.found_inf is not None and bool(overflow.item()):
            plan.why_not = "a gradient is not finite"
        coefficient: torch.Tensor | None = None
        if self.gradient_clipping > 0:
            coefficient = (self.gradient_clipping / (norm + 1e-6)).clamp_(max=1.0)
            if judged and plan.why_not is None and bool(coefficient != 1.0):
                plan.why_not = "the gradients are clipped"  # (x * 1 is x: unclipped, the early steps made this step)
            if scale != 1.0:
                coefficient.mul_(1.0 / scale)
        elif scale != 1.0:
            coefficient = torch.full((), 1.0 / scale, dtype=torch.float32, device=norm.device)
        if self.early is not None:  # (judged)
            self.early.values_refused(plan.why_not)
        # Once, where the step runs: a host step (ZeRO-Offload beside a GPU) waits for the values, as it must.
        plan.coefficient = coefficient.to(self.step_device) if coefficient is not None else None
        if plan.found_inf is not None:
            plan.found_inf = plan.found_inf.to(self.step_device)
        return None

    def _walk(self, plan: StepPlan) -> None:
        """The update, a sub-group at a time, then the second agreement: committed on every rank, or
        abandoned on every rank (a transactional tier), or every rank raises and the engine diverged."""
        arrived = self.grads.arrived
        idle = {i for i, sub in enumerate(self.sub_groups) if not any(arrived[piece.sp] for piece in sub.pieces)}
        # The sub-groups the backward stepped early, kept where they made this step's operation (see
        # zero3.step.early_step's Note); else undone, and stepped below with the rest.
        stepped_early = plan.early.keep_or_undo(plan.why_not) if plan.early is not None else set()
        work, coefficient, found_inf = plan.work, plan.coefficient, plan.found_inf
        assert work is not None
        failure: BaseException | None = None
        if self.exchange is not None:
            try:
                assert self.muon is not None
                self.muon.orthogonalize(self.states, self.grads.arrived, self.torch_state.fresh, self._fill_grad,
                                        coefficient, idle, work)
            except Exception as error:  # noqa: BLE001 - every rank raises it, below
                failure = error
            self.protocol.raise_together("step", failure, NOT_APPLIED,
                                         undo=lambda: plan.put_back(self.loss_scaler, self.skipped))
        streamed = self.states.transactional
        # The scalars to put back if the walk fails on some rank: only a transactional tier's step can be
        # abandoned; a memory tier's failed walk leaves the engine refusing to train until a checkpoint is
        # loaded (the Note), which brings every scalar back.
        before = self.scalar_snapshot() if streamed else None
        # A sub-group's new shards are written as soon as it has stepped (on a GPU they copy while the
        # next one steps), except into a disk file beside masters kept in memory: those masters are
        # updated in place, so the shards go after the whole walk.
        during = streamed or not self._lp_on_disk

        def visit(index: int, window: dict[str, torch.Tensor]) -> None:
            sub = self.sub_groups[index]
            grad = self.grads.in_place_window(work, sub.offset, sub.numel) if self.grads_in_place else work[: sub.numel]
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
            self._abandon(before, lambda: plan.put_back(self.loss_scaler, self.skipped), streamed)
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
        if not self.torch_state.views_bound:
            self.torch_state.bind(sub, window)
        for piece, master, piece_grad in zip(sub.pieces, sub.masters, piece_grads):
            master.grad = piece_grad if arrived[piece.sp] else None
        if self.fused:
            self.optimizer.found_inf = found_inf  # read by torch's fused kernels only
        try:
            self.optimizer.step()
        finally:
            for master in sub.masters:  # (torch steps every parameter with a .grad: none may stay set)
                master.grad = None
        if self.torch_state.fresh:
            self.torch_state.adopt(sub, window)

    # ---- per-parameter state (checkpoints) -------------------------------------------
    def has_state(self, sp: ShardedParam) -> bool:
        return self.torch_state.has_state(sp)

    def scalar_state(self, sp: ShardedParam) -> dict[str, torch.Tensor]:
        return self.torch_state.scalar_state(sp)

    def set_states(self, scalars_by_param: Mapping[ShardedParam, dict[str, torch.Tensor] | None]) -> None:
        """zero3.step.torch_state's `set_states`, once nothing may be reading the state in place."""
        self.before_state_change()
        self.torch_state.set_states(scalars_by_param, self.states.buffers)

    def read_client_state(self, client: torch.optim.Optimizer) -> None:
        """Take over the state a client optimizer already has for its parameters (zero3.step.torch_state)."""
        self.before_state_change()
        stepped = self.torch_state.take_client_state(client, self.params, self.masters)
        self.torch_state.set_states(stepped, self.states.buffers)

    def scalar_snapshot(self) -> ScalarSnapshot:
        return self.torch_state.snapshot()

    def restore_scalars(self, snapshot: ScalarSnapshot) -> None:
        self.torch_state.restore(snapshot)

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
            if sp.master_slots is slots:
                sp.master_slots = None
            if slots.hp in sp.followers:
                sp.followers.remove(slots.hp)
            if sp.master_keeper is self:
                sp.master_keeper = None
        self.masters.clear()
