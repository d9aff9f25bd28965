"""Torch's optimizer over the shards: each sub-group's pieces as the parameters torch steps ("masters"),
the state torch keeps for each, bound to views of the flat buffers, and the scalars a failed step puts back.

[Note: master views]
Torch's optimizer holds tensors, not slots: each master is a view of
the sub-group's window of `hp_params` (or of its shard, where the
masters are the shards) and its moments are views of the moment
windows. Those views would pin the old storage when a state is
offloaded, so `unbind_views` drops them (the offload tier calls it
before moving `hp_params` or `optim_states`, or `lp_params` where it
holds the masters, and a disk tier's walk
after every step: its windows are reused) and each step binds them
again from the windows it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from zero3.partition.flat_buffer import FlatBuffer, Slot
from zero3.partition.sharded_param import ShardedParam
from zero3.step.grad_shards import Piece
from zero3.step.layout import ScalarSnapshot, SubGroup


class MasterSlotsLike(Protocol):
    """A parameter's optimizer-side slots (zero3.step.optimizer's MasterSlots): its moments, by name."""

    moments: dict[str, Slot]


class TorchOptimizerState:
    """The masters of every sub-group's pieces and torch's state for them. A piece is `fresh` until torch
    has created its state (at its first step, as the class does it), which `adopt` then moves into the flat
    buffers ([Note: optimizer layout])."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, sub_groups: list[SubGroup], state_names: tuple[str, ...],
        scalar_names: tuple[str, ...], step_device: torch.device,
        shard_master: Callable[[Piece], torch.Tensor] | None,
    ) -> None:
        self.optimizer = optimizer
        self.sub_groups = sub_groups
        self.state_names = state_names
        self.scalar_names = scalar_names
        self.step_device = step_device
        # Where the masters are the shards: a piece's master is a view of its shard ([Note: masters that are
        # the shards]); else it views the window of hp_params it is stepped in.
        self._shard_master = shard_master
        self.masters_by_param: dict[ShardedParam, list[nn.Parameter]] = {}
        for sub in sub_groups:
            for piece, master in zip(sub.pieces, sub.masters):
                self.masters_by_param.setdefault(piece.sp, []).append(master)
        self.fresh: set[nn.Parameter] = {master for sub in sub_groups for master in sub.masters}
        self.views_bound = False  # the masters and moments view the buffers (see the Note)

    # ---- the views --------------------------------------------------------------------------
    def bind_views(self, buffers: Mapping[str, FlatBuffer]) -> None:
        for sub in self.sub_groups:
            self.bind(sub, {name: buffer.view(sub.offset, sub.numel) for name, buffer in buffers.items()})
        self.views_bound = True

    def bind(self, sub: SubGroup, window: dict[str, torch.Tensor]) -> None:
        cursor = 0
        for piece, master in zip(sub.pieces, sub.masters):
            if self._shard_master is not None:
                master.data = self._shard_master(piece)
            else:
                master.data = window["hp_params"][cursor : cursor + piece.numel]
            state = self.optimizer.state[master]
            for name in self.state_names:
                if name in state:
                    state[name] = window[name][cursor : cursor + piece.numel]
            cursor += piece.numel

    def adopt(self, sub: SubGroup, window: dict[str, torch.Tensor]) -> None:
        """Move the state torch created at a piece's first step into the flat buffers."""
        cursor = 0
        for piece, master in zip(sub.pieces, sub.masters):
            state = self.optimizer.state[master]
            if master in self.fresh and state:
                for name in self.state_names:
                    if name in state:
                        view = window[name][cursor : cursor + piece.numel]
                        view.copy_(state[name])
                        state[name] = view
                self.fresh.discard(master)
            cursor += piece.numel

    def unbind_views(self) -> None:
        self.views_bound = False
        for sub in self.sub_groups:
            for master in sub.masters:
                master.data = torch.empty(0, device=self.step_device)
                state = self.optimizer.state[master]
                for name in self.state_names:
                    if name in state:
                        state[name] = torch.empty(0, device=self.step_device)

    # ---- per parameter (checkpoints, accessors, fault tolerance) -------------------------------------
    def has_state(self, sp: ShardedParam) -> bool:
        """Whether torch has created this parameter's optimizer state (it has been stepped)."""
        return bool(self.optimizer.state[self.masters_by_param[sp][0]])

    def scalar_state(self, sp: ShardedParam) -> dict[str, torch.Tensor]:
        """The parameter's scalar state (Adam: its step count), as tensors; every piece holds the same."""
        state = self.optimizer.state[self.masters_by_param[sp][0]]
        return {name: torch.as_tensor(state[name]).detach().clone() for name in self.scalar_names if name in state}

    def set_states(self, scalars_by_param: Mapping[ShardedParam, dict[str, torch.Tensor] | None],
                   buffers: Mapping[str, FlatBuffer]) -> None:
        """Mark each parameter stepped with its scalars (its elementwise states were written into the
        buffers), or, with None, never stepped (torch creates its state at its next step); the views are
        bound once for all (a load sets every parameter)."""
        for sp, scalars in scalars_by_param.items():
            for master in self.masters_by_param[sp]:
                state = self.optimizer.state[master]
                state.clear()
                if scalars is None:
                    self.fresh.add(master)
                    continue
                self.fresh.discard(master)
                for name, value in scalars.items():
                    state[name] = value.to(device=self.step_device).clone()
                for name in self.state_names:
                    state[name] = torch.empty(0, device=self.step_device)  # bound to the buffers below
        if self.views_bound:
            self.bind_views(buffers)

    # ---- the scalars of a step that may be put back -----------------------------------------------
    def snapshot(self) -> ScalarSnapshot:
        """Every piece's scalar state (and whether it has any) before a step, to put back if the step fails
        on some rank (a transactional tier's) or its early part is undone (zero3.step.early_step). The
        0-dim tensors of one name (Adam's step counts) are copied in one `stack`, not one clone per piece:
        this runs at every such step."""
        fresh: list[nn.Parameter] = []
        tensors: dict[str, tuple[list[nn.Parameter], list[torch.Tensor]]] = {name: ([], []) for name in self.scalar_names}
        loose: list[tuple[nn.Parameter, str, Any]] = []
        for sub in self.sub_groups:
            for master in sub.masters:
                if master in self.fresh:
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

    def restore(self, snapshot: ScalarSnapshot) -> None:
        """After a failed walk: every piece's scalars (and whether it had state) as before the step."""
        for master in snapshot.fresh:
            self.optimizer.state[master].clear()
            self.fresh.add(master)
        for name, (masters, values) in snapshot.stacked.items():
            for master, value in zip(masters, values.unbind()):
                self.optimizer.state[master][name] = value.clone()  # its own storage, as torch made it
        for master, name, value in snapshot.loose:
            self.optimizer.state[master][name] = value

    def take_client_state(self, client: torch.optim.Optimizer, params: list[ShardedParam],
                          masters: Mapping[ShardedParam, MasterSlotsLike]) -> dict[ShardedParam, dict[str, torch.Tensor] | None]:
        """The state a client optimizer already has for `params`: this rank's shard of each elementwise state
        written into its slot; returns the scalars of each parameter it has stepped, for `set_states`."""
        stepped: dict[ShardedParam, dict[str, torch.Tensor] | None] = {}
        for sp in params:
            state = client.state.get(sp.param)
            if not state:
                continue
            missing = [name for name in self.state_names if not isinstance(state.get(name), torch.Tensor)]
            if missing:
                raise ValueError(
                    f"the client optimizer's state for {sp.name} lacks {missing} (it has {sorted(state)})"
                )
            slots = masters[sp]
            for name in self.state_names:
                full = state[name].detach()
                if full.numel() != sp.numel:
                    raise ValueError(
                        f"the client optimizer's {name!r} for {sp.name} has {full.numel()} elements, "
                        f"the parameter {sp.numel}"
                    )
                slots.moments[name].write(sp.shard_of(full.to(dtype=torch.float32, device="cpu")))
            stepped[sp] = {name: torch.as_tensor(state[name]) for name in self.scalar_names if name in state}
        return stepped
