"""`GatheredParameters`: whole parameters inside a `with` block; `unwrap_model_for_generation`, all of them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch import nn

from zero3.moe.expert_parallel import expert_share
from zero3.partition.flat_buffer import Slot
from zero3.partition.sharded_param import ShardedParam, sharded
from zero3.step_protocol import StepProtocol
from zero3.partition.unit import GatherUnit, Hold, unit_of

log = logging.getLogger("zero3")


class GatheredParameters:
    """Gather `params` on entry and release them on exit.

    With `modifier_rank=r`, rank r's values on exit (edited in place inside the
    block) are broadcast and become every rank's shards, fp32 master included,
    for the listed parameters only: the others gathered with them (a unit is
    gathered whole) keep their masters bit-identical.
    Without a modifier rank, a parameter edited in place inside the block is an
    error on every rank at exit (its edit would be lost), as in DeepSpeed.
    Must be entered on every rank (it is collective). Tensors that are not
    partitioned are accepted and left alone, as in DeepSpeed.
    """

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor | None] | None,
        modifier_rank: int | None = None,
        fwd_module: object | None = None,
        enabled: bool = True,
    ) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        candidates = [p for p in (params or []) if p is not None]
        for p in candidates:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"GatheredParameters: expected parameters, got {type(p).__name__}")
        units: dict[int, GatherUnit] = {}
        self.listed: set[ShardedParam] = set()
        for p in candidates:
            sp = sharded(p)
            unit = unit_of(sp) if sp is not None else None
            if sp is not None and unit is not None:
                units.setdefault(id(unit), unit)
                self.listed.add(sp)
        self.units = list(units.values())
        if modifier_rank is not None:
            shared = [sp.name for sp in self.listed if expert_share(sp.param) is not None]
            if shared:
                # One rank's values cannot become every rank's: an expert-parallel group's ranks hold other experts.
                raise ValueError(
                    f"GatheredParameters(modifier_rank={modifier_rank!r}) on shared-out expert weights "
                    f"({shared[0]}, ...): each rank holds its own experts, so no one rank's values are every rank's; "
                    "set their values with load_checkpoint, or before zero3.initialize shares the experts out")
        if modifier_rank is not None and self.units:
            world = self.units[0].gather.mesh.shard_size
            if not isinstance(modifier_rank, int) or not 0 <= modifier_rank < world:
                raise ValueError(f"GatheredParameters: modifier_rank={modifier_rank!r}, expected None or a rank in [0, {world})")
        self.modifier_rank = modifier_rank
        self.enabled = enabled

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        for unit in self.units:
            unit.acquire(Hold.PIN)
        self._prepare()
        for unit in self.units:  # issue every all-gather before waiting on any (exactly, under qwZ)
            unit.fetch(exact=True)
        for unit in self.units:
            unit.wait()
        if self.modifier_rank is not None:
            quantized = [unit.label for unit in self.units if not unit.exact_values]
            if quantized:  # inside a forward or backward, which gathers as the pass does
                for unit in self.units:
                    unit.release(Hold.PIN)
                raise RuntimeError(
                    f"GatheredParameters(modifier_rank={self.modifier_rank}) inside a forward or backward under "
                    f"zero_quantized_weights: {quantized} were gathered quantized, and writing them back would "
                    "keep the quantization error in the weights; modify parameters between steps"
                )
        # Without a modifier rank an edit would be dropped on exit: note each parameter's storage and version
        # to say so then (DeepSpeed raises on every rank, too).
        self._versions = [(sp, sp.param.data_ptr(), sp.param._version) for sp in self.listed]
        return self

    def _prepare(self) -> None:
        """Between passes, each rank brings in the shards it will send from their tier (host memory beside a
        GPU, or disk: reads that can fail on one rank alone) before any all-gather is issued, and the ranks
        agree that every one could: where one could not, every rank raises (that rank its own exception, the
        others one naming it) with nothing gathered, rather than leaving the others in gathers it never
        joins. Shards that live on the device need no agreement (a view of them cannot fail), and whether
        a unit has a tier is the config's, the same on every rank. Inside a pass the walk gathers, and a
        failure there is the pass's (zero3.passes.gather_walk)."""
        direct = [unit for unit in self.units if unit.gathers_directly()]
        protocol = self._protocol()
        if protocol is None or not any(unit.source is not None for unit in direct):
            return
        own: Exception | None = None
        try:
            for unit in direct:
                unit.prepare_gather(exact=True)
        except Exception as error:  # noqa: BLE001 - every rank raises it, below
            own = error

        def let_go() -> None:
            for unit in self.units:
                unit.drop_prepared()
                unit.release(Hold.PIN)

        protocol.raise_together("GatheredParameters", own, " (on entering the block; nothing was gathered)", undo=let_go)

    def _protocol(self) -> StepProtocol | None:
        """Where this block's agreements are made: its engine's step protocol (zero3.step_protocol), or one
        over the parameters' communicator where no engine drives them (zero3.Init's, before initialize); None
        where they never communicate."""
        if not self.units or self.units[0].gather.comm is None:
            return None
        driver = self.units[0].driver
        return driver.protocol if driver is not None else StepProtocol(self.units[0].gather.comm)

    def _write_back_agreed(self) -> None:
        """The modifier's values become every rank's shards (16-bit, master), on every rank or on none: each
        rank keeps what it overwrites, and where a write failed on any rank (a tier's disk), every rank puts
        its own back and raises. A rank that cannot put back its 16-bit shard (the disk still failing) has
        every rank's optimizer rewrite them from the masters before the next use (`lp_stale`, agreed); a
        unit kept gathered holds the modifier's values then, so it is gathered again at the next forward."""
        protocol = self._protocol()
        with torch.no_grad():
            for unit in self.units:
                assert unit.unsharded is not None and unit.gather.comm is not None
                unit.gather.comm.broadcast(unit.unsharded, src=self.modifier_rank)
        listed = [sp for unit in self.units for sp in unit.params if sp in self.listed]
        kept: list[tuple[Slot, torch.Tensor]] = []
        seeds = [(sp, sp.hp_seed.clone()) for sp in listed if sp.hp_seed is not None]
        own: Exception | None = None
        wrote = False
        try:
            for sp in listed:
                slots = [sp.lp_slot] if sp.lp_slot is not None else []  # (none for a lean parameter)
                kept += [(slot, slot.read().clone()) for slot in (*slots, *sp.followers)]
            wrote = True
            with torch.no_grad():
                for unit in self.units:
                    unit.write_back(self.listed)
        except Exception as error:  # noqa: BLE001 - every rank raises it, below
            own = error
        if protocol is None or not protocol.flags([own is not None])[0]:
            if own is not None:
                raise own
            return
        unrestored = False
        if wrote:
            for slot, values in reversed(kept):
                try:
                    slot.write(values)
                except Exception:  # noqa: BLE001 - repaired from the masters, below
                    unrestored = True
            for sp, seed in seeds:
                assert sp.hp_seed is not None
                sp.hp_seed.copy_(seed)
        for unit in self.units:
            unit.stale = unit.stale or unit.persistent
        if protocol.flags([unrestored])[0]:
            for sp in listed:
                if sp.master_keeper is not None:
                    sp.master_keeper.lp_stale = True
        protocol.fail_together("GatheredParameters", own, " (no rank kept the modifier's values)")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Collective whatever happened in the block: if it raised on any rank, every rank raises (the
        failing rank its own exception, the others one naming it) and no rank keeps the modifier's edit;
        else the modifier's values become every rank's shards, or an edit without one is discarded, as
        DeepSpeed discards it, with one warning (rank 0's) naming what every rank edited; under
        `enable_sanity_checks` every rank raises instead, as DeepSpeed does."""
        if not self.enabled:
            return
        edited: list[str] = []
        try:
            protocol = self._protocol()
            own: list[str] = []
            if self.modifier_rank is None and exc is None:
                own = sorted(sp.name for sp, pointer, version in self._versions
                             if sp.param.data_ptr() != pointer or sp.param._version != version)
            failed = edit = False
            if protocol is not None:
                # One small all-reduce, on every rank: did any rank's block raise, did any edit without a
                # modifier (the names travel only then). A rank that skipped it would leave the others waiting.
                failed, edit = protocol.flags([exc is not None, bool(own)])
            if failed:
                assert protocol is not None
                protocol.raise_if_peer_failed("GatheredParameters", exc, " (no rank kept an edit made in the block)")
                return  # this rank's own exception goes on
            if edit:
                assert protocol is not None
                edited = [f"{', '.join(names)} on rank {rank}" for rank, names in protocol.exchange(own) if names]
            if self.modifier_rank is not None and self.units:
                self._write_back_agreed()
        finally:
            for unit in self.units:
                unit.release(Hold.PIN)
        if edited and any(unit.sanity_checks for unit in self.units):  # (the same config on every rank)
            raise RuntimeError(
                f"in-place modification of partitioned parameters ({'; '.join(edited)}) inside "
                "GatheredParameters(modifier_rank=None), refused on every rank under "
                "zero_optimization.enable_sanity_checks: the edit was discarded. Pass modifier_rank=<the rank "
                "whose values to keep> to keep it")
        if edited and torch.distributed.get_rank() == 0:
            log.warning("in-place modification of partitioned parameters (%s) inside GatheredParameters("
                        "modifier_rank=None): the edit was discarded on exit, on every rank. Pass modifier_rank=<the "
                        "rank whose values to keep> to keep it", "; ".join(edited))


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[nn.Module]:
    """The whole module for `generate` (DeepSpeed's and TRL's name): every parameter gathered for the
    block, so a generation loop of many short forwards gathers nothing per token. Takes the engine or
    its module; collective (every rank enters it). Costs the whole model's 16-bit bytes on each rank."""
    module = getattr(model, "module", model)
    if not isinstance(module, nn.Module):
        raise TypeError(f"unwrap_model_for_generation takes a zero3 engine or a module, got {type(model).__name__}")
    with GatheredParameters(list(module.parameters())):
        yield module
