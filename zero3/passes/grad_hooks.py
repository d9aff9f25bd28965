"""Where gradients enter the engine: a hook pair on every trained parameter, and the bracket of a
backward pass (the coordinator holds what backward reads, the reducer sends what it makes).

[Note: gradients accumulated in place]
A gradient normally reaches the engine through a post-accumulate hook: autograd
stores it as `param.grad`, the hook hands it to the reducer and drops it. At a
world of one that saves for backward by reference (zero3.passes.coordinator),
where a parameter's gradient would only be added to its `lp_grads` slot as it
is (same dtype, no scaling), autograd can do that itself: a pre-hook, run as
the gradient arrives, points `param.grad` at the slot (shaped like the
parameter) and autograd's own accumulation adds into it in place, as it does
into any existing `.grad`. No hook runs after accumulation, which is most of
the gradient path's host time there. `param.grad` is dropped again when the
pass ends, so outside backward it is None at every world size. A backward that
records a graph (`create_graph=True`) accumulates out of place, so there the
pre-hook adds the gradient to the slot itself.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from zero3.partition.sharded_param import ShardedParam
from zero3.partition.unit import GatherUnit, UnitState
from zero3.passes.coordinator import ParamCoordinator
from zero3.passes.grad_reducer import GradientReducer
from zero3.step.grad_shards import GradShards
from zero3.step.loss_scaler import DynamicLossScaler, LossScaler

log = logging.getLogger("zero3")


class BackwardPass:
    def __init__(
        self,
        units: list[GatherUnit],
        persistent_unit: GatherUnit | None,
        coordinator: ParamCoordinator,
        reducer: GradientReducer,
        grads: GradShards | None,
        device: torch.device,
        gradient_accumulation_steps: int,
        loss_scaler: LossScaler | DynamicLossScaler,
    ) -> None:
        self.units = units
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.loss_scaler = loss_scaler
        self.manually_scaled = False  # engine.scale(loss) was called for the next plain loss.backward()
        self.coordinator = coordinator
        self.reducer = reducer
        self.grads = grads
        self._handles: list[Any] = []
        # Parameters whose .grad this pass pointed at their slots (see the Note), dropped when it ends.
        self._attached: list[tuple[ShardedParam, GatherUnit]] = []
        in_place = coordinator.saves_by_reference and reducer.adds_unchanged
        for unit in units + ([persistent_unit] if persistent_unit is not None else []):
            for sp in unit.params:
                if not sp.param.requires_grad:
                    continue
                proxy = torch.empty(1, dtype=sp.dtype, device=device).expand(sp.shape)
                if in_place and grads is not None and sp in grads and grads.dtype == sp.dtype:
                    self._handles.append(sp.param.register_hook(self._accumulate_in_place(sp, unit, proxy)))
                    continue
                self._handles.append(sp.param.register_hook(_pre_accumulate(sp, unit, proxy)))
                self._handles.append(sp.param.register_post_accumulate_grad_hook(self._post_accumulate(sp, unit)))

    def _post_accumulate(self, sp: ShardedParam, unit: GatherUnit):
        # Runs once per parameter per backward: what can be looked up now is (a world of one's host time).
        grads, reducer, coordinator = self.grads, self.reducer, self.coordinator
        trained = grads is not None and sp in grads
        arrived = grads.arrived if grads is not None else {}

        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            param.grad = None
            if unit.state is UnitState.SHARDED:
                sp.set_released()
            if grad is None:
                return
            if not trained:
                log.warning("parameter %s requires grad but is not in the optimizer; its gradient is dropped", sp.name)
            else:
                if not reducer.open:
                    self.begin(plain=True)  # a plain loss.backward() outside engine.backward
                arrived[sp] = True
                reducer.add(sp, grad)
            coordinator.grad_arrived(unit)

        return hook

    def _accumulate_in_place(self, sp: ShardedParam, unit: GatherUnit, proxy: torch.Tensor):
        """The pre-hook that lets autograd add the gradient into its lp_grads slot (see the Note)."""
        reducer, grads, param = self.reducer, self.grads, sp.param
        assert grads is not None
        arrived = grads.arrived
        heap_return = reducer.heap_return  # on the CPU: freed heap handed back as gradients land (host_heap)
        slot_bytes = sp.numel * grads.dtype.itemsize  # the slot is shaped like the parameter

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not reducer.open:
                self.begin(plain=True)  # a plain loss.backward() outside engine.backward
            arrived[sp] = True
            factor = reducer.direct_factor
            if factor != 1.0:
                grad = grad * factor
            slot = reducer.direct_view(sp)
            heap_return.landed(slot_bytes)
            if torch.is_grad_enabled() or unit.state is not UnitState.UNSHARDED:
                # Out of place (a graph is recorded), or the parameter holds no full value to match a .grad:
                # added here; autograd keeps its own copy as .grad until the pass ends.
                slot.add_(grad.detach())
                if unit.state is not UnitState.UNSHARDED:
                    param.data = proxy
                param.grad = None
            elif param.grad is slot:
                return grad
            else:
                param.grad = slot
            self._attached.append((sp, unit))
            return grad

        return hook

    def begin(self, plain: bool = False) -> None:
        """Open a pass. `plain`: opened by a gradient of a `loss.backward()` called outside engine.backward.

        [Note: a plain loss.backward()]
        As in DeepSpeed 0.19, a plain `loss.backward()` trains as
        `engine.backward(loss)` does: its gradients are divided by the
        accumulation steps (here, in the bucket before the sum across ranks),
        and under an fp16 loss scale the loss must have gone through
        `engine.scale(loss)` first (an unscaled fp16 backward would underflow
        silently: it is an error, raised by every rank at the same gradient).
        """
        if self.reducer.open:
            return
        scale = 1.0
        if plain:
            manually_scaled, self.manually_scaled = self.manually_scaled, False
            if self.loss_scaler.loss_scale != 1.0 and not manually_scaled:
                raise RuntimeError(
                    "fp16 loss scaling needs the loss scaled before backward, and loss.backward() was called on an "
                    "unscaled loss: call engine.backward(loss), or engine.scale(loss).backward()"
                )
            scale = 1.0 / self.gradient_accumulation_steps
        self.coordinator.begin_backward()
        # A parameter whose unit no forward used since the last backward cannot get a gradient.
        used = self.coordinator.used_since_backward
        self.reducer.begin((sp for unit in self.units if unit not in used for sp in unit.params), scale)

    @property
    def open(self) -> bool:
        return self.reducer.open or self.coordinator.in_backward

    def finish(self, failure: BaseException | None = None) -> None:
        """End the backward pass on every rank together, then land every gradient reduction.

        `failure`: what ended this rank's backward early. The pass's last marker
        carries every rank's "failed" flag; if any rank's is set, each rank that
        did not fail raises the failing rank's exception type
        (zero3.rank_failure), after every reduction has landed, so the
        ranks' collectives stay paired and `engine.zero_grad()` can drop the lot.
        """
        if not self.open:
            return
        for sp, unit in self._attached:  # outside backward, .grad is None (see the Note)
            sp.param.grad = None
            if unit.state is UnitState.SHARDED:
                sp.set_released()
        self._attached.clear()
        extras = self.coordinator.end_backward([int(self.reducer.has_late), int(failure is not None)])
        self.reducer.finish(any_rank_late=any(row[0] for row in extras))
        if len(extras) > 1 and any(row[1] for row in extras):  # one row: no peers were asked
            walk_failure = self.coordinator.backward_walk.failure  # met while following the pass through
            self.coordinator.protocol.raise_if_peer_failed("backward", failure or walk_failure)
            if failure is None and walk_failure is not None:
                raise walk_failure

    def join_as_failed(self, failure: BaseException) -> None:
        """This rank failed after its forward while the others are in their backward: an empty backward,
        ended at once with this rank's flag set, so every other rank raises `failure`."""
        self.begin()
        self.finish(failure)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _pre_accumulate(sp: ShardedParam, unit: GatherUnit, proxy: torch.Tensor):
    def hook(grad: torch.Tensor) -> None:
        # Autograd accumulates into a tensor of the parameter's shape; a
        # released parameter gets a storage-free stand-in of that shape.
        if unit.state is not UnitState.UNSHARDED:
            sp.param.data = proxy
        return None

    return hook
