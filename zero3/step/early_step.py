"""ZeRO-Offload's host step, begun during the backward and settled exactly at `engine.step()`.

[Note: the overlapped host step]
With ZeRO-Offload the optimizer steps on the host after the backward, and the
accelerator waits for it. With `offload_optimizer.super_offload: true` (the key
DeepSpeed's SuperOffload reads) the boundary micro-step's backward steps each
sub-group on a host thread as soon as its last gradient shard has landed in
`lp_grads`, while the backward goes on. What the step needs from every
gradient (the global norm for clipping, an overflow, every rank's agreement
that it steps) is only known at `engine.step()`, so the early steps are
speculative:
* before the first of them, every piece's scalar state (step counts) is
  copied; before each, its sub-group's window (masters and moments);
* each steps a private fp32 copy of the sub-group's gradients (lp_grads is
  left as the backward made it), with the coefficient the step would use were
  nothing clipped (1, or 1/loss scale) and no overflow; a sub-group any of
  whose parameters has no gradient on this rank, or whose gradients land
  only once the backward's computation is over (it would start no earlier
  than the step), is left to the step;
* at `engine.step()` the step agrees as always (a failure in an early step
  is this rank's failure there), then keeps the early steps only where the
  step it would have made is the same operation: no rank failed, no
  overflow, the clipping coefficient exactly 1 (x * 1 is x), no late
  gradient round, the parameter groups' hyperparameters unchanged. It then
  steps the other sub-groups and writes every stepped sub-group's 16-bit
  shards. Otherwise it copies every window and the scalars back and steps as
  if nothing had run early. Either way the result is bit-identical to the
  step without overlap (tests/test_overlapped_step.py).
Anything else that reads or writes the masters or moments, or writes the
gradients, between the backward and the step (zero_grad, a checkpoint,
offload_states, the safe_get/safe_set accessors of masters and optimizer
states, safe_set of gradients, another backward) first waits for the early
steps and undoes them, so no one sees a speculated value. (Reading the
gradients needs nothing: the early steps leave lp_grads as it was.)

A step refused for what the gradients held (clipped, or not finite) is
likely followed by another: early in training the gradient norm stays above
`gradient_clipping` for many steps, and every early step would be undone and
stepped again (the host step's cost twice over). So after such a step the
next backward steps nothing early (`skipped`); the step after one whose
gradients would have kept its early steps speculates again. The step decides
either way, so what is skipped changes no value, only when it is computed.

The price is host memory: each early-stepped sub-group's window is held,
copied, until the step (at most the whole optimizer state again), and a
host thread. A gradient reaches lp_grads when its bucket's reduction lands,
so a world of one on the CPU (gradients added by autograd as they are made,
no buckets) steps after the backward as before.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Protocol

import torch

from zero3.helper_threads import HelperThreads
from zero3.offload.optimizer_tier import OptimizerStates
from zero3.partition.sharded_param import ShardedParam
from zero3.step.grad_shards import GradShards
from zero3.step.loss_scaler import LossScaler
from zero3.step.layout import ScalarSnapshot, SubGroup


class HostStepper(Protocol):
    """What the early steps use of the optimizer they step ahead of (zero3.step.optimizer's)."""

    sub_groups: list[SubGroup]
    states: OptimizerStates
    grads: GradShards
    fused: bool
    loss_scaler: LossScaler
    before_state_change: Callable[[], None]  # a save may be reading the state in place

    @property
    def step_device(self) -> torch.device: ...

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def scalar_snapshot(self) -> ScalarSnapshot: ...

    def restore_scalars(self, snapshot: ScalarSnapshot) -> None: ...

    def step_sub_group(self, sub: SubGroup, window: dict[str, torch.Tensor], coefficient: torch.Tensor | None,
                       found_inf: torch.Tensor | None, grad: torch.Tensor | None, fill_grad: bool) -> None: ...


@dataclass
class _Early:
    """One sub-group stepped early: its window as it was before, to put back."""

    index: int
    saved: dict[str, torch.Tensor]
    started: float
    ended: float = 0.0


def _put_window_back(early: _Early, window: dict[str, torch.Tensor]) -> None:
    for name, saved in early.saved.items():
        window[name].copy_(saved)


@dataclass
class EarlyStepStats:
    """What the overlapped steps did over the engine's life (tests and benchmarks read it)."""

    kept: int = 0  # sub-groups whose early step was kept
    undone: int = 0  # sub-groups whose early step was undone
    undone_reasons: dict[str, int] = field(default_factory=dict)
    skipped: int = 0  # boundary backwards that stepped nothing early: the step before was refused for its values
    skipped_reasons: dict[str, int] = field(default_factory=dict)
    # The last boundary step: seconds from the backward's start to each early step's start and end, and
    # to the backward's end (the timeline benchmarks/offload_overlap.py prints).
    last_timeline: list[tuple[float, float]] = field(default_factory=list)
    last_backward_s: float = 0.0


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _same_hyperparameters(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> bool:
    """Every group with the same keys and the same values (a key added or dropped is a change too)."""
    return len(before) == len(now) and all(
        a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a) for a, b in zip(before, now))


def _hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: (value.clone() if isinstance(value, torch.Tensor) else value)
             for key, value in group.items() if key != "params"} for group in param_groups]


class EarlySteps:
    """The overlapped host step of one optimizer (see the Note)."""

    def __init__(self, optimizer: HostStepper) -> None:
        self.optimizer = optimizer
        self.stats = EarlyStepStats()
        # Each parameter's sub-groups, and each sub-group's parameters (a parameter may span several).
        self._subs_of: dict[ShardedParam, list[int]] = {}
        self._params_of: list[set[ShardedParam]] = []
        for index, sub in enumerate(optimizer.sub_groups):
            params = {piece.sp for piece in sub.pieces}
            self._params_of.append(params)
            for sp in params:
                self._subs_of.setdefault(sp, []).append(index)
        self._worker: HelperThreads | None = None
        # Whether a sub-group whose gradients land once the backward's computation is over steps early too
        # (not by default: it would start no earlier than the step). Which sub-groups land during the
        # computation depends on when each reduction finishes; the tests set this to make every one early.
        self.after_computation = False
        self._armed = False
        self._waiting: list[int] = []  # per sub-group: its parameters whose shards have not landed
        self._jobs: list[Future[_Early | None]] = []
        self._scalars: ScalarSnapshot | None = None
        self._hyperparameters: list[dict[str, Any]] = []
        self._coefficient: torch.Tensor | None = None
        self._found_inf: torch.Tensor | None = None
        self._began = 0.0
        self._late = False
        self._computed = False
        self._submitted = 0
        self._done: list[_Early] = []
        # Why the last step would have refused early steps for its gradients' values (see the Note), if so.
        self._refused_last: str | None = None

    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self, loss_scale: float) -> None:
        """The boundary micro-step's backward begins: sub-groups step as their gradients land."""
        if self._armed:
            self.undo("another backward before the step")
        if self._refused_last is not None:  # likely refused again: step after the backward, once
            self.stats.skipped += 1
            self.stats.skipped_reasons[self._refused_last] = self.stats.skipped_reasons.get(self._refused_last, 0) + 1
            return
        optimizer = self.optimizer
        if any(buffer.parked for buffer in optimizer.states.buffers.values()):
            return  # parked by offload_states: the step is refused until reload_states, so nothing steps early
        optimizer.before_state_change()  # the early steps change the state a save may be reading in place
        device = optimizer.step_device
        self._scalars = optimizer.scalar_snapshot()
        self._hyperparameters = _hyperparameters(optimizer.param_groups)
        # The step's own coefficient when nothing is clipped (see optimizer.step): 1/scale, or none at all.
        self._coefficient = None if loss_scale == 1.0 else torch.full((), 1.0 / loss_scale, dtype=torch.float32,
                                                                        device=device)
        self._found_inf = (torch.zeros((), dtype=torch.float32, device=device)
                           if optimizer.fused and not optimizer.loss_scaler.dynamic else None)
        self._waiting = [len(params) for params in self._params_of]
        self._jobs = []
        self._submitted = 0
        self._late = False
        self._computed = False
        self._began = time.perf_counter()
        self.stats.last_timeline = []
        self._armed = True

    def landed(self, params: list[ShardedParam]) -> None:
        """These parameters' gradient shards were added to lp_grads (the reducer's landing)."""
        if not self._armed or (self._computed and not self.after_computation):
            return  # (once the backward's computation is over, the step itself is as early as any)
        arrived = self.optimizer.grads.arrived
        for sp in params:
            for index in self._subs_of.get(sp, ()):
                self._waiting[index] -= 1
                if self._waiting[index] == 0 and all(arrived[other] for other in self._params_of[index]):
                    self._submit(index)

    def values_refused(self, why: str | None) -> None:
        """What this step's gradients said, armed or not: `why` the early steps would not be its operation
        (clipped, not finite), or None where they would be. The next backward speculates only after None."""
        self._refused_last = why

    def late_gradients(self) -> None:
        """A late round added gradients after their buckets had landed (the early steps used too few)."""
        self._late = True

    def backward_computed(self) -> None:
        """The backward's computation is over (what is left lands its last reductions): a sub-group whose
        gradients land from now on would start no earlier than the step, and is left to it, uncopied."""
        if self._armed:
            self._computed = True
            self.stats.last_backward_s = time.perf_counter() - self._began

    def _submit(self, index: int) -> None:
        if self._worker is None:
            self._worker = HelperThreads(1, "zero3-early-step")
        self._jobs.append(self._worker.submit(self._step, index))
        self._submitted += 1

    def _step(self, index: int) -> _Early:
        optimizer = self.optimizer
        sub = optimizer.sub_groups[index]
        started = time.perf_counter() - self._began
        window = {name: buffer.view(sub.offset, sub.numel) for name, buffer in optimizer.states.buffers.items()}
        early = _Early(index, {name: view.clone() for name, view in window.items()}, started)
        grad = torch.empty(sub.numel, dtype=torch.float32, device=optimizer.step_device)
        try:
            optimizer.step_sub_group(sub, window, self._coefficient, self._found_inf, grad, fill_grad=True)
        except BaseException:
            _put_window_back(early, window)  # a step that failed part-way leaves nothing behind
            raise
        early.ended = time.perf_counter() - self._began
        return early

    def _finish_jobs(self) -> tuple[list[_Early], BaseException | None]:
        done: list[_Early] = []
        failure: BaseException | None = None
        for job in self._jobs:
            try:
                done.append(job.result())
            except BaseException as error:  # noqa: BLE001 - this rank's step failure, agreed by the step
                failure = failure or error
        self._jobs = []
        return done, failure

    def wait(self) -> BaseException | None:
        """Wait for every early step (the step begins); what one raised, if any, as this rank's failure."""
        if not self._armed:
            return None
        self._done, failure = self._finish_jobs()
        return failure

    def keep_or_undo(self, why_not: str | None) -> set[int]:
        """After `wait`: keep the early steps (`why_not` None and the hyperparameters unchanged), returning
        the sub-groups they stepped; or put everything back as before them, returning none."""
        if not self._armed:
            return set()
        done = self._done
        if why_not is None and self._late:
            why_not = "late gradients"
        if why_not is None and not _same_hyperparameters(self._hyperparameters,
                                                         _hyperparameters(self.optimizer.param_groups)):
            why_not = "the hyperparameters changed"
        if why_not is None:
            self.stats.kept += len(done)
            self.stats.last_timeline = [(early.started, early.ended) for early in done]
            self._disarm()
            return {early.index for early in done}
        self._put_back(done, why_not)
        return set()

    def undo(self, why: str) -> None:
        """Wait for the early steps and put back what they changed (someone outside the step needs the state)."""
        if not self._armed:
            return
        done, _ = self._finish_jobs()
        self._put_back(self._done + done, why)  # (those `wait` collected, and any still running)

    def _put_back(self, done: list[_Early], why: str) -> None:
        optimizer = self.optimizer
        for early in done:
            sub = optimizer.sub_groups[early.index]
            _put_window_back(early, {name: buffer.view(sub.offset, sub.numel)
                                     for name, buffer in optimizer.states.buffers.items()})
        if self._submitted:  # (a step that failed part-way may have counted its steps too)
            assert self._scalars is not None
            optimizer.restore_scalars(self._scalars)
        if done:
            self.stats.undone += len(done)
            self.stats.undone_reasons[why] = self.stats.undone_reasons.get(why, 0) + len(done)
        self._disarm()

    def _disarm(self) -> None:
        self._armed = False
        self._done = []
        self._scalars = None
        self._hyperparameters = []
        self._waiting = []

    def close(self) -> None:
        self.undo("the engine is destroyed")
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
