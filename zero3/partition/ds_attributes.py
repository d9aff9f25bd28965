"""DeepSpeed's read-only attributes on a partitioned parameter: `ds_numel`, `ds_shape`, `ds_status`,
`ds_id`, `ds_tensor`, `ds_persist` (compatibility for code written against DeepSpeed; Hugging Face
reads `ds_numel` to count the parameters of a model built under `zero3.Init`). zero3's own code
never reads them: they are the compatibility surface, answered from zero3's state.

They are computed from zero3's own records each time they are read (the parameter's
`ShardedParam` and its gather unit), never kept as a second state. A parameter gets them by its
class: while partitioned, it is an instance of a subclass of its own class (`nn.Parameter` for
most) that adds the properties, and it gets its class back when the engine releases it.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from zero3.enums import ParamStatus
from zero3.partition.sharded_param import ShardedParam, sharded
from zero3.partition.unit import unit_of

_IDS = itertools.count()
_WITH_ATTRIBUTES: dict[type, type] = {}


class _Gathered:
    """What `all_gather_coalesced` returns: DeepSpeed's handle, already complete."""

    def wait(self) -> None:
        return None


class ShardTensor(torch.Tensor):
    """`param.ds_tensor`'s type: the shard's values, whose `.data` assignment writes new values into the
    16-bit shard, as DeepSpeed code sets a partition (`param.ds_tensor.data = values`, same numel). Like
    DeepSpeed's, the fp32 master keeps its values; a copy of the parameter gathered now is gathered again
    at its next use. Operations on it give plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    _record: ShardedParam

    @staticmethod
    def of(values: torch.Tensor, record: ShardedParam) -> ShardTensor:
        out = values.as_subclass(ShardTensor)
        out._record = record
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:  # saved and copied as the plain values it shows
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self).as_subclass(torch.Tensor)

    @data.setter
    def data(self, values: torch.Tensor) -> None:
        record = self._record
        slot = record.lp_slot
        if slot is None:
            raise RuntimeError(
                f"ds_tensor.data = ...: parameter {record.name!r} keeps no 16-bit shard in lean memory mode (it is "
                "cast from its master): set it with zero3.safe_set_local_fp32_param")
        if values.numel() != slot.numel:
            raise ValueError(f"ds_tensor.data = ...: parameter {record.name!r}'s shard has {slot.numel} elements "
                             f"(padded to whole shards), got a tensor of shape {tuple(values.shape)}")
        slot.write(values.detach().reshape(-1))
        torch.Tensor.data.__set__(self, slot.read() if slot.buffer.store is not None else slot.view())
        unit = unit_of(record)
        if unit is not None:
            unit.shards_changed()


class DeepSpeedAttributes:
    """The properties (mixed into the parameter's own class)."""

    def _record(self) -> ShardedParam:
        sp = sharded(self)  # type: ignore[arg-type]
        if sp is None:
            raise AttributeError("this parameter is no longer partitioned by zero3")
        return sp

    @property
    def ds_numel(self) -> int:
        """The whole parameter's number of elements (its `.numel()` is 0 while it is released)."""
        return self._record().numel

    @property
    def ds_shape(self) -> torch.Size:
        """The whole parameter's shape."""
        return self._record().shape

    @property
    def ds_status(self) -> ParamStatus:
        """NOT_AVAILABLE, INFLIGHT or AVAILABLE, as its gather unit is (zero3.ZeroParamStatus)."""
        sp = self._record()
        unit = unit_of(sp)
        if unit is not None:
            return unit.status
        return ParamStatus.AVAILABLE if sp.param.data.numel() == sp.numel else ParamStatus.NOT_AVAILABLE

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's shard of the 16-bit parameter (flat, padded to whole shards): a view of the
        `lp_params` buffer, valid until the next optimizer step (which writes it in place); a copy when
        the shard lives on disk (offload_param nvme), or is cast from the master (lean memory mode). Raises
        StateOffloadedError while it is parked. `param.ds_tensor.data = values` writes the shard (see
        `ShardTensor`)."""
        record = self._record()
        slot = record.lp_slot
        if slot is None and record.lean_master is not None:
            return ShardTensor.of(record.read_lp(), record)
        if slot is None:
            raise AttributeError("this parameter has no shard yet")
        if slot.buffer.store is not None:
            return ShardTensor.of(slot.read(), record)
        return ShardTensor.of(slot.view(), record)

    def all_gather_coalesced(self, params: list[torch.Tensor] | None = None, safe_mode: bool = False) -> _Gathered:
        """DeepSpeed's `param.all_gather_coalesced(params)`: `params` (default: this one) gathered whole and
        kept so until `param.partition()`; collective (every rank gathers the same parameters). Returns a
        handle whose `wait()` returns at once: the gather has completed. A block of `GatheredParameters`
        underneath, so edits are discarded at `partition()` as there."""
        from zero3.partition.gathered import GatheredParameters

        listed = [self] if params is None else list(params)
        records = [sharded(p) for p in listed]
        if any(record is None for record in records):
            raise ValueError("all_gather_coalesced: every parameter must be partitioned by zero3")
        held = [record.name for record in records if record is not None and record.held_gather is not None]
        if held:
            raise RuntimeError(f"all_gather_coalesced: {', '.join(held)} already gathered by an earlier "
                               "all_gather_coalesced: call param.partition() first")
        block = GatheredParameters(listed)
        block.__enter__()
        for record in records:
            assert record is not None
            record.held_gather = block
        return _Gathered()

    def all_gather(self, param_list: list[torch.Tensor] | None = None, async_op: bool = False) -> _Gathered:
        """DeepSpeed's `param.all_gather(param_list)`: as `all_gather_coalesced`."""
        return self.all_gather_coalesced(param_list)

    def partition(self, param_list: list[torch.Tensor] | None = None, has_been_updated: bool = False) -> None:
        """DeepSpeed's `param.partition(param_list)`: release what `all_gather_coalesced` gathered (the whole
        block each listed parameter was gathered in); collective as that was. An edit made meanwhile is
        discarded, as DeepSpeed discards it; `has_been_updated=True` (keep it) is refused: use
        `GatheredParameters(..., modifier_rank=r)`."""
        if has_been_updated:
            raise NotImplementedError("param.partition(has_been_updated=True): write edits back with "
                                      "GatheredParameters(params, modifier_rank=<the rank whose values to keep>)")
        listed = [self] if param_list is None else list(param_list)
        blocks = []
        for p in listed:
            record = sharded(p)
            if record is not None and record.held_gather is not None and record.held_gather not in blocks:
                blocks.append(record.held_gather)
        for block in blocks:
            for sp in block.listed:
                sp.held_gather = None
            block.__exit__(None, None, None)

    @property
    def ds_persist(self) -> bool:
        """Whether the parameter stays gathered between uses (stage3_param_persistence_threshold)."""
        unit = unit_of(self._record())
        return bool(unit is not None and unit.persistent)

    @property
    def ds_id(self) -> int:
        """A number unique to the parameter in this process, given when it was partitioned."""
        return self._record().ds_id


def wear(sp: ShardedParam) -> None:
    """Give the parameter the attributes (it keeps its identity: only its class changes)."""
    param = sp.param
    cls = type(param)
    if issubclass(cls, DeepSpeedAttributes):
        return
    sp.ds_id = next(_IDS)
    with_attributes = _WITH_ATTRIBUTES.get(cls)
    if with_attributes is None:
        with_attributes = type(cls.__name__, (DeepSpeedAttributes, cls), {"__module__": cls.__module__})
        _WITH_ATTRIBUTES[cls] = with_attributes
    param.__class__ = with_attributes


def take_off(param: nn.Parameter) -> None:
    """The parameter's own class back (the engine that partitioned it is gone)."""
    cls = type(param)
    if issubclass(cls, DeepSpeedAttributes):
        param.__class__ = next(base for base in cls.__mro__[1:] if not issubclass(base, DeepSpeedAttributes))
