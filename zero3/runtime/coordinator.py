"""When parameters are gathered and released: module hooks, prefetch, backward.

[Note: who holds a gathered unit]
A unit stays gathered while anyone needs it (`GatherUnit.needed`):
* forward frames: a module's pre-forward hook acquires the units of every
  parameter in its `_parameters` (its own, and tied ones it shares); its
  post-forward hook releases them. A parameter read by attribute from another
  module's forward is acquired into the running frame (`on_access`), and one
  that a forward returns is handed to the caller's frame, so it stays valid
  where it is used (the "dangling bias").
* backward: forward runs under saved-tensor hooks. A saved tensor that lives in
  a gathered unit's storage is saved as a reference (the storage is freed on
  release); unpacking it in backward re-gathers the unit and holds it until
  all of the unit's gradients have been accumulated. Any use of a parameter in
  backward, whichever module made it, is therefore covered.
* prefetch: the order of acquisitions is recorded every forward; the next
  forward (and the backward, in reverse) issues async all-gathers ahead along
  the previous order while the actual order matches it. On the first
  mismatch prefetching stops for that pass: a stale trace costs overlap,
  never correctness. Unclaimed prefetches are released when the pass ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zero3.partition.sharded_param import ShardedParam, sharded
from zero3.partition.unit import GatherUnit, UnitState


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


def _params_in(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """Partitioned parameters found in a forward's output (any container or object)."""
    if isinstance(value, torch.Tensor):
        return [value] if isinstance(value, nn.Parameter) and sharded(value) is not None else []
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
        found.extend(_params_in(item, depth + 1))
    return found


class ParamCoordinator:
    def __init__(
        self,
        module: nn.Module,
        units: list[GatherUnit],
        module_units: dict[nn.Module, list[GatherUnit]],
        prefetch_numel: int,
        max_live_numel: int,
        persistent_unit: GatherUnit | None = None,
    ) -> None:
        self.module = module
        self.units = units
        # Gathered once and kept; released only when its shards are offloaded.
        self.persistent_unit = persistent_unit
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self._module_units = module_units
        self._frames: list[_Frame] = []
        self._forward_depth = 0
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._by_storage: dict[int, GatherUnit] = {}
        self._root_returned: list[GatherUnit] = []
        self._prefetched: set[GatherUnit] = set()
        # Acquisition order of the previous and the current forward.
        self._last_trace: list[GatherUnit] = []
        self._trace: list[GatherUnit] = []
        self._trace_matches = False
        self._backward_order: list[GatherUnit] = []
        self._backward_pos = 0
        self._in_backward = False
        self._handles: list[RemovableHandle] = []
        for unit in units:
            unit.observer = self._observe
            for sp in unit.params:
                sp.on_access = self._on_access

    # ---- hook installation -------------------------------------------------
    def install(self) -> None:
        self._handles.append(self.module.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        for mod, units in self._module_units.items():
            if not units:
                continue
            self._handles.append(mod.register_forward_pre_hook(self._pre_forward))
            self._handles.append(mod.register_forward_hook(self._post_forward, always_call=True))
        # Registered last so it runs after the root module's own post-forward hook.
        self._handles.append(self.module.register_forward_hook(self._root_post_forward, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit in self.units:
            unit.observer = None
            for sp in unit.params:
                sp.on_access = None

    # ---- state ---------------------------------------------------------------
    @property
    def in_forward(self) -> bool:
        return self._forward_depth > 0

    @property
    def in_backward(self) -> bool:
        return self._in_backward

    def _observe(self, unit: GatherUnit, gathered: bool) -> None:
        assert unit.unsharded is not None
        ptr = unit.unsharded.untyped_storage().data_ptr()
        if gathered:
            self._by_storage[ptr] = unit
        else:
            self._by_storage.pop(ptr, None)

    def live_numel(self) -> int:
        return sum(u.numel for u in self.units if u.state is not UnitState.SHARDED and not u.persistent)

    def _acquire(self, unit: GatherUnit, frame: _Frame) -> None:
        unit.refcount += 1
        frame.held.append(unit)
        self._prefetched.discard(unit)
        if self._forward_depth > 0 and not self._in_backward:
            self._record(unit)
        unit.start_unshard(async_op=False)
        unit.wait()

    def _release_frame(self, frame: _Frame) -> None:
        for unit in frame.held:
            unit.refcount -= 1
            unit.release_if_unneeded()
        frame.held.clear()

    # ---- forward -------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._forward_depth += 1
        if self._forward_depth > 1:
            return
        if self.persistent_unit is not None:
            self.persistent_unit.unshard()  # no-op unless an offload of lp_params released it
        self._release_root_returned()
        self._last_trace = self._trace or self._last_trace
        self._trace = []
        self._trace_matches = bool(self._last_trace)
        self._frames.append(_Frame(module, []))
        if torch.is_grad_enabled():
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward_depth -= 1
        if self._forward_depth > 0:
            return
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        frame = self._frames.pop()
        for param in _params_in(output):
            unit = sharded(param).unit  # type: ignore[union-attr]
            assert unit is not None
            unit.refcount += 1
            self._root_returned.append(unit)
        self._release_frame(frame)
        self._drop_unclaimed_prefetches()
        self._backward_order = list(dict.fromkeys(reversed(self._trace)))
        self._backward_pos = 0

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        frame = _Frame(module, [])
        self._frames.append(frame)
        for unit in self._module_units[module]:
            self._acquire(unit, frame)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        frame = self._frames.pop()
        assert frame.module is module, "forward hooks ran out of order"
        returned = _params_in(output)
        if returned:
            parent = self._frames[-1] if self._frames else None
            for param in returned:
                unit = sharded(param).unit  # type: ignore[union-attr]
                assert unit is not None
                unit.refcount += 1
                (parent.held if parent is not None else self._root_returned).append(unit)
        self._release_frame(frame)

    def _on_access(self, sp: ShardedParam) -> None:
        unit = sp.unit
        if not self._frames or unit is None or unit.persistent:
            return
        frame = self._frames[-1]
        if unit in frame.held:
            return
        self._acquire(unit, frame)

    def _record(self, unit: GatherUnit) -> None:
        position = len(self._trace)
        self._trace.append(unit)
        if not self._trace_matches:
            return
        if position >= len(self._last_trace) or self._last_trace[position] is not unit:
            self._trace_matches = False
            return
        self._prefetch(self._last_trace, position + 1)

    def _prefetch(self, order: list[GatherUnit], start: int) -> None:
        budget = self.prefetch_numel
        live = self.live_numel()
        for unit in order[start:]:
            if budget <= 0:
                break
            budget -= unit.numel
            if unit.state is not UnitState.SHARDED or unit.persistent:
                continue
            if live + unit.numel > self.max_live_numel:
                break
            unit.start_unshard(async_op=True)
            live += unit.numel
            self._prefetched.add(unit)

    def _drop_unclaimed_prefetches(self) -> None:
        for unit in list(self._prefetched):
            unit.release_if_unneeded()
        self._prefetched.clear()

    def _release_root_returned(self) -> None:
        returned, self._root_returned = self._root_returned, []
        for unit in returned:
            unit.refcount -= 1
            unit.release_if_unneeded()

    # ---- backward --------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._by_storage or tensor.layout is not torch.strided:
            return tensor
        unit = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if unit is None or unit.persistent:
            return tensor
        return _SavedUnitView(unit, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedUnitView):
            return saved
        unit = saved.unit
        self.hold_for_backward(unit)
        assert unit.unsharded is not None
        return unit.unsharded.as_strided(saved.size, saved.stride, saved.offset)

    def hold_for_backward(self, unit: GatherUnit) -> None:
        if unit.state is not UnitState.UNSHARDED:
            unit.start_unshard(async_op=False)
            unit.wait()
        self._prefetched.discard(unit)
        unit.backward_held = True
        self._advance_backward(unit)

    def _advance_backward(self, unit: GatherUnit) -> None:
        order = self._backward_order
        pos = self._backward_pos
        if pos < len(order) and order[pos] is unit:
            self._backward_pos = pos + 1
            self._prefetch(order, pos + 1)
        elif unit in order[pos:]:
            # Skipped ahead (a unit with no saved tensors): resync to the new position.
            self._backward_pos = order.index(unit, pos) + 1
            self._prefetch(order, self._backward_pos)

    def begin_backward(self) -> None:
        self._in_backward = True
        for unit in self.units:
            unit.pending_grads = sum(1 for sp in unit.params if sp.param.requires_grad and sp.grad_slot is not None)

    def on_unit_grads_done(self, unit: GatherUnit) -> None:
        if unit.backward_held:
            unit.backward_held = False
            unit.release_if_unneeded()

    def end_backward(self) -> None:
        self._in_backward = False
        for unit in self.units:
            unit.backward_held = False
            unit.release_if_unneeded()
        self._prefetched.clear()
        self._release_root_returned()

    def release_all(self) -> None:
        """Release everything not pinned: before a step, an offload, or destroy."""
        self._release_root_returned()
        for unit in list(self._prefetched):
            unit.wait()
        self._prefetched.clear()
        for unit in self.units:
            unit.backward_held = False
            unit.release_if_unneeded()
