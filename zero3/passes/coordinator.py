"""When parameters are gathered and released: module hooks, the gather walks, backward.

[Note: who holds a gathered unit]
A unit stays gathered while anyone holds it (`GatherUnit.acquire`, by `Hold`):
* forward frames: a module's pre-forward hook acquires the units of every
  parameter in its `_parameters` (its own, and tied ones it shares), of its
  registered external parameters, and, for a leaf module, its descendants';
  its post-forward hook releases them. A parameter read by attribute from another
  module's forward is acquired into the running frame (`on_access`), and one
  that a forward returns is handed to the caller's frame, so it stays valid
  where it is used (the "dangling bias").
* backward: forward runs under saved-tensor hooks. A saved tensor that lives in
  a gathered unit's storage is saved as a reference (the storage is freed on
  release); unpacking it in backward re-gathers the unit and holds it until
  all of the unit's gradients have been accumulated. Any use of a parameter in
  backward, whichever module made it, is therefore covered. Every other saved
  tensor is saved detached: saving the tensor itself would let an output hold
  its own graph node, a reference cycle that keeps a forward's activations
  alive after its output is dropped.
  A world of one whose units all gather in place (their parameters view the
  shards: nothing is freed on release) needs none of that: see [Note: saved
  by reference].
* the gather walk: every gather of a pass goes through that pass's lockstep
  walk (zero3.passes.gather_walk), which also prefetches. Units it gathered
  ahead are held by the walk until claimed, or released when it needs room
  or the pass ends.

[Note: saved by reference]
Saved-tensor hooks cost a Python call per saved tensor in forward and another
in backward, and make autograd's C++ call into Python each time: a real share
of the step at a world of one with small layers, where the host's work per
step is what the device waits for. When every unit gathers in place, a gathered
unit's values are views of its shard, so a saved tensor stays valid however
often the unit is released and gathered again; only the parameters themselves,
which autograd saves by reference as it does every leaf, must view their shards
again when backward reads them. So forward runs without the hooks: a unit a
graph-recording forward uses is held for backward (`Hold.BACKWARD`) until that
root forward ends (a backward inside the forward, a gradient penalty, finds it
gathered), released then as always, and gathered again in place before the
backward's first node runs: by `begin_backward` for `engine.backward`, and by
a hook on the root forward's outputs for a plain `loss.backward()` (or a second
backward through a retained graph).

A pass is a root forward, or a backward (begun by `engine.backward`, or by
the first saved tensor or gradient of a plain `loss.backward()`). When one
ends, every rank leaves it together (the walk's last marker), so an
exception in forward or backward that every rank raises leaves nothing
gathered or in flight.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zero3.comm import Communicator
from zero3.partition import param_dict
from zero3.shard_mesh import ShardMesh
from zero3.partition.sharded_param import ShardedParam, sharded
from zero3.partition.secondary import SecondaryShards
from zero3.partition.unit import GatherUnit, Hold, UnitState
from zero3.passes.gather_walk import GatherWalk, LiveCount
from zero3.step.grad_shards import GradShards
from zero3.passes.walk_keeper import WalkKeeper
from zero3.step_protocol import StepProtocol, TrainingState


def expected_grads(unit: GatherUnit, grads: GradShards | None) -> int:
    """Gradients a backward accumulates for the unit: its parameters that are trained."""
    if grads is None:
        return 0
    return sum(1 for sp in unit.params if sp.param.requires_grad and sp in grads)


@dataclasses.dataclass
class _Frame:
    module: nn.Module
    held: list[GatherUnit]


@dataclasses.dataclass(frozen=True)
class _SavedUnitView:
    unit: GatherUnit
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _tensors_in(value: Any, wanted: Callable[[torch.Tensor], bool], depth: int = 0) -> list[torch.Tensor]:
    """The `wanted` tensors in a forward's output (any container or object)."""
    if isinstance(value, torch.Tensor):
        return [value] if wanted(value) else []
    if depth > 4 or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return []
    if isinstance(value, Mapping):
        items = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__") and not isinstance(value, nn.Module):
        items = vars(value).values()
    else:
        return []
    found: list[torch.Tensor] = []
    for item in items:
        found.extend(_tensors_in(item, wanted, depth + 1))
    return found


def _params_in(value: Any) -> list[torch.Tensor]:
    """Partitioned parameters found in a forward's output."""
    return _tensors_in(value, lambda t: isinstance(t, nn.Parameter) and sharded(t) is not None)


def _grad_tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensors in a forward's output that a backward can start from."""
    return _tensors_in(value, lambda t: t.grad_fn is not None)


class ParamCoordinator:
    def __init__(
        self,
        module: nn.Module,
        units: list[GatherUnit],
        module_units: dict[nn.Module, list[GatherUnit]],
        comm: Communicator,
        mesh: ShardMesh,
        prefetch_numel: int,
        max_live_numel: int,
        persistent_unit: GatherUnit | None = None,
        grads: GradShards | None = None,
        secondary: SecondaryShards | None = None,
        protocol: StepProtocol | None = None,
    ) -> None:
        self.module = module
        # Every agreement a pass makes (zero3.step_protocol): its own where no engine gave one.
        self.protocol = protocol if protocol is not None else StepProtocol(comm)
        self.units = units
        # Gathered once and kept; released only when its shards are offloaded.
        self.persistent_unit = persistent_unit
        self._module_units = module_units
        self.live = LiveCount()
        # hpZ's secondary shards (zero3.partition.secondary): recorded in a forward, agreed at its end.
        self.secondary = secondary
        # The forward's last marker carries whether a rank's forward raised (zero3.rank_failure), and under
        # hpZ the units whose secondary shards it recorded.
        self.forward_walk = GatherWalk("forward", units, comm, mesh, self.live, prefetch_numel, max_live_numel,
                                       1 + (secondary.words if secondary is not None else 0), failure_slot=0)
        self.comm = comm
        # The backward's last marker also says whether a rank has gradients to reduce late, and whether it failed.
        self.backward_walk = GatherWalk("backward", units, comm, mesh, self.live, prefetch_numel, max_live_numel, 2,
                                        failure_slot=1)
        self.forward_walk.set_order(list(range(len(units))))  # the backward's first order: see begin_backward
        # Issues a walk for this rank while its thread is away (a model's own collective: see the walk's Note).
        self.keeper = WalkKeeper([self.forward_walk, self.backward_walk], units[0].device if units else torch.device("cpu"))
        self._walk: GatherWalk | None = None  # the pass under way
        self._frames: list[_Frame] = []
        self._forward_depth = 0  # a root forward may call itself: only the outermost begins and ends the pass
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._by_storage: dict[int, GatherUnit] = {}
        self._root_returned: list[GatherUnit] = []
        # Units acquired by a forward since the last backward ended: only their
        # parameters can receive gradients (the reducer counts the others as zero).
        self.used_since_backward: set[GatherUnit] = set()
        # Gradients each unit's backward still waits for: the unit is held until its last one is in.
        self._grads = grads
        self._grads_due: dict[GatherUnit, int] = {}
        self._handles: list[RemovableHandle] = []
        self._all_units = units + ([persistent_unit] if persistent_unit is not None else [])
        self._unit_of = {sp: unit for unit in self._all_units for sp in unit.params}
        # See [Note: saved by reference].
        self.saves_by_reference = all(unit.gathers_in_place for unit in units)
        for unit in self._all_units:
            unit.attach(self)
            for sp in unit.params:
                sp.on_access = self._on_access

    # ---- hook installation -------------------------------------------------
    def install(self) -> None:
        self.keeper.start()
        self._handles.append(self.module.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        for mod, units in self._module_units.items():
            if not units:
                continue
            self._handles.append(mod.register_forward_pre_hook(self._pre_forward))
            self._handles.append(mod.register_forward_hook(self._post_forward, always_call=True))
        # Registered last so it runs after the root module's own post-forward hook.
        self._handles.append(self.module.register_forward_hook(self._root_post_forward, always_call=True))
        # A module none of whose parameters a read can gather (each is in the persistent unit, or in no
        # unit) has nothing to report: its `_parameters` goes back to a plain dict, read without a call
        # into Python (a small model's forward reads each parameter through it).
        for module in self.module.modules():
            if all(self._reads_gather_nothing(param) for param in module._parameters.values()):
                param_dict.uninstall(module)

    def _reads_gather_nothing(self, param: nn.Parameter | None) -> bool:
        sp = sharded(param) if param is not None else None
        unit = self._unit_of.get(sp) if sp is not None else None
        return unit is None or unit.persistent

    def remove(self) -> None:
        self.keeper.stop()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit in self._all_units:
            unit.detach()
            for sp in unit.params:
                sp.on_access = None

    # ---- state ---------------------------------------------------------------
    @property
    def in_forward(self) -> bool:
        return self.protocol.in_forward

    @property
    def in_backward(self) -> bool:
        return self.protocol.in_backward

    def observe(self, unit: GatherUnit, old: UnitState, new: UnitState) -> None:
        self.live.observe(unit, old, new)
        if unit.persistent:
            return  # never saved by reference (see _pack), so never looked up
        if new is UnitState.UNSHARDED:
            assert unit.unsharded is not None
            self._by_storage[unit.unsharded.untyped_storage().data_ptr()] = unit
        elif old is UnitState.UNSHARDED:
            assert unit.unsharded is not None
            self._by_storage.pop(unit.unsharded.untyped_storage().data_ptr(), None)

    def live_numel(self) -> int:
        return self.live.numel

    def gathers_directly(self) -> bool:
        return self._walk is None

    def fetch(self, unit: GatherUnit, exact: bool = False) -> None:
        """Start gathering a unit this rank needs now: through the pass's walk (as the pass gathers it), or
        directly between passes (`exact`: never from quantized values)."""
        if self._walk is not None:
            self._walk.fetch(unit)
        else:
            unit.start_unshard(async_op=True, exact=exact)

    def _acquire(self, unit: GatherUnit, frame: _Frame) -> None:
        unit.acquire(Hold.FORWARD)
        if self.saves_by_reference and torch.is_grad_enabled():
            unit.acquire(Hold.BACKWARD)  # backward reads its parameters as they are then
        frame.held.append(unit)
        self.used_since_backward.add(unit)
        self.fetch(unit)
        unit.wait()

    def _release_frame(self, frame: _Frame) -> None:
        for unit in frame.held:
            unit.release(Hold.FORWARD)
        frame.held.clear()

    # ---- forward -------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._forward_depth += 1
        if self._forward_depth > 1:
            return
        persistent = self.persistent_unit
        if persistent is not None:
            # A local setter changed some rank's shards of it (zero3.accessors), maybe on that rank alone:
            # every rank gathers it again, so no rank gathers alone. One flag, agreed on the control group
            # (not inside a backward, whose walk's keeper may be using that group: the next forward does it).
            if self.protocol.state is not TrainingState.BACKWARD and self.protocol.flags([persistent.stale])[0]:
                persistent.reshard()
            persistent.unshard()  # no-op unless an offload of lp_params released it, or it was stale
        self._release_root_returned()
        # A forward inside backward (a checkpointed root) gathers along the backward walk.
        if self.protocol.state is TrainingState.BACKWARD:
            self.protocol.state = TrainingState.FORWARD_IN_BACKWARD
        else:
            self.protocol.state = TrainingState.FORWARD
        if self._walk is None:
            self._walk = self.forward_walk
            self.forward_walk.begin()
            if self.secondary is not None:
                self.secondary.begin_forward(records=torch.is_grad_enabled())
        self._frames.append(_Frame(module, []))
        if torch.is_grad_enabled() and not self.saves_by_reference:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Also runs when forward raises (always_call): the pass ends on every rank either way, and a
        failure on one rank is raised on every rank (zero3.rank_failure)."""
        if self._forward_depth == 0:
            return
        failure = sys.exc_info()[1]  # set when this hook runs for a forward that raised
        self._forward_depth -= 1
        if self._forward_depth > 0:
            return
        self._exit_saved_hooks()
        while self._frames:
            frame = self._frames.pop()
            if frame.module is module:
                for param in _params_in(output):
                    unit = self._unit_of[sharded(param)]  # type: ignore[index]
                    unit.acquire(Hold.FORWARD)
                    self._root_returned.append(unit)
            self._release_frame(frame)
        self.protocol.state = TrainingState.BACKWARD if self.in_backward else TrainingState.IDLE
        if self.saves_by_reference and self.protocol.state is TrainingState.IDLE:
            self._release_until_backward(output)
        if self._walk is self.forward_walk:  # this forward began its own walk
            self._walk = None
            recorded = self.secondary.recorded_words() if self.secondary is not None else []
            extras = self.forward_walk.end([int(failure is not None), *recorded])
            failed = any(row[0] for row in extras)
            if self.secondary is not None:
                if failed:
                    self.secondary.forget()
                else:
                    self.secondary.agree([row[1:] for row in extras])
            if self.forward_walk.lockstep and failed:
                walk_failure = self.forward_walk.failure  # met while following the pass through
                self.protocol.raise_if_peer_failed("forward", failure or walk_failure)
                if failure is None and walk_failure is not None:
                    raise walk_failure

    def _release_until_backward(self, output: Any) -> None:
        """The end of a root forward that saved by reference: its units released, to be gathered again
        when a backward through its outputs begins (see [Note: saved by reference])."""
        held = [unit for unit in self.used_since_backward if unit.holds(Hold.BACKWARD)]
        for unit in held:
            unit.release(Hold.BACKWARD)
        if not held:
            return

        def regather(grad: torch.Tensor) -> None:
            if not self.in_backward:
                self.begin_backward()  # a plain loss.backward()
            self._hold_in_place(held)

        for tensor in _grad_tensors_in(output):
            tensor.register_hook(regather)

    def _hold_in_place(self, units: Iterable[GatherUnit]) -> None:
        for unit in units:
            if unit.holds(Hold.BACKWARD):
                continue  # engine.backward's begin held it before the outputs' hook ran
            unit.unshard()  # in place: the parameters view their shards again
            unit.acquire(Hold.BACKWARD)

    def join_forward_as_failed(self, failure: BaseException) -> None:
        """This rank failed before its forward while the others are in theirs: walk an empty forward pass
        with them (it gathers what they need) and end it with this rank's flag set, so every other rank
        raises `failure` (see the engine's Note on failures between its calls)."""
        walk = self.forward_walk
        if not walk.lockstep or self._walk is not None:
            return
        walk.begin()
        walk.end([1])
        if self.secondary is not None:
            self.secondary.forget()
        self.protocol.raise_if_peer_failed("forward", failure)

    def _exit_saved_hooks(self) -> None:
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        frame = _Frame(module, [])
        self._frames.append(frame)
        for unit in self._module_units[module]:
            self._acquire(unit, frame)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # Also runs when forward raised (always_call); the frame is missing if our pre-hook raised.
        if not self._frames or self._frames[-1].module is not module:
            return
        frame = self._frames.pop()
        returned = _params_in(output)
        if returned:
            parent = self._frames[-1] if self._frames else None
            for param in returned:
                unit = self._unit_of[sharded(param)]  # type: ignore[index]
                unit.acquire(Hold.FORWARD)
                (parent.held if parent is not None else self._root_returned).append(unit)
        self._release_frame(frame)

    def _on_access(self, sp: ShardedParam) -> None:
        unit = self._unit_of.get(sp)
        if not self._frames or unit is None or unit.persistent:
            return
        frame = self._frames[-1]
        if unit in frame.held:
            return
        self._acquire(unit, frame)

    def _release_root_returned(self) -> None:
        returned, self._root_returned = self._root_returned, []
        for unit in returned:
            unit.release(Hold.FORWARD)

    # ---- backward --------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        if self._by_storage and tensor.layout is torch.strided:
            unit = self._by_storage.get(tensor.untyped_storage().data_ptr())
            if unit is not None and not unit.persistent:
                return _SavedUnitView(unit, tensor.size(), tensor.stride(), tensor.storage_offset())
        return tensor.detach()

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedUnitView):
            return saved
        unit = saved.unit
        self.hold_for_backward(unit)
        assert unit.unsharded is not None
        return unit.unsharded.as_strided(saved.size, saved.stride, saved.offset)

    def hold_for_backward(self, unit: GatherUnit) -> None:
        if not self.in_backward:
            self.begin_backward()  # a plain loss.backward()
        self.fetch(unit)
        unit.wait()
        unit.acquire(Hold.BACKWARD)

    def begin_backward(self) -> None:
        if self.in_backward:
            return
        self.protocol.state = TrainingState.BACKWARD_IN_FORWARD if self.in_forward else TrainingState.BACKWARD
        if self.backward_walk.passes == 0:
            # First backward: expect the reverse of the forward's gathers (the same on every rank).
            self.backward_walk.set_order(list(dict.fromkeys(reversed(self.forward_walk.order))))
        if self._walk is None:
            self._walk = self.backward_walk
            self.backward_walk.begin()
        if self.saves_by_reference:  # held to the end: releasing earlier frees nothing (see the Note)
            self._hold_in_place(self.used_since_backward)
        else:
            self._grads_due = {unit: n for unit in self.units if (n := expected_grads(unit, self._grads))}

    def grad_arrived(self, unit: GatherUnit) -> None:
        """A gradient of one of the unit's parameters has been accumulated; after its last one,
        backward needs the unit no more."""
        due = self._grads_due.get(unit)
        if due is None:
            return
        if due > 1:
            self._grads_due[unit] = due - 1
            return
        del self._grads_due[unit]
        if unit.holds(Hold.BACKWARD):
            unit.release(Hold.BACKWARD)

    def end_backward(self, extra: list[int] | None = None) -> list[list[int]]:
        """Leave the backward pass on every rank together; returns every rank's `extra` ints."""
        extras = [list(extra or [])]
        if not self.in_backward:
            return extras
        self.protocol.state = TrainingState.FORWARD if self.in_forward else TrainingState.IDLE
        for unit in self.units:
            unit.release_all(Hold.BACKWARD)
        self._release_root_returned()
        if self._walk is self.backward_walk:
            self._walk = None
            extras = self.backward_walk.end(extra or [])
        if self.secondary is not None:
            self.secondary.end_backward()
        self.used_since_backward.clear()
        return extras

    # ---- between steps -----------------------------------------------------------
    def release_all(self) -> None:
        """Release everything not pinned: before a step, an offload, or destroy."""
        self._release_root_returned()
        for walk in (self.forward_walk, self.backward_walk):
            walk.release_unclaimed()
        for unit in self.units:
            unit.release_all(Hold.BACKWARD)

    def reset(self) -> None:
        """After an exception escaped forward or backward: drop every hold, end any open pass.

        Ending a pass is collective, so this is called on every rank (by `engine.zero_grad()`).
        """
        self._exit_saved_hooks()
        for frame in self._frames:
            for unit in frame.held:
                unit.release(Hold.FORWARD)
        self._frames.clear()
        self._forward_depth = 0
        if self.in_backward:
            self.end_backward()
        if self._walk is not None:
            walk, self._walk = self._walk, None
            walk.end()
        if self.secondary is not None:
            self.secondary.forget()
        self.release_all()
