"""`zero3.Init`: partition parameters as each module's constructor finishes.

[Note: writes after partitioning]
A module's parameters are partitioned when its own constructor returns, so a
model larger than one rank's memory can be built. A parent constructor that
then re-initialises a child's weights (`self.apply(self._init_weights)`,
`nn.init.normal_(self.fc.weight)`, `self.fc.weight.data.zero_()`) would write
into a released, zero-element placeholder: DeepSpeed loses those writes
silently. Here a torch-function mode watches every torch call made inside the
context. A call that writes a partitioned parameter (an in-place method,
`__setitem__`, or an `out=` argument) is run on the gathered full fp32 value,
and the result is broadcast from rank 0 and re-sharded: the write takes effect,
exactly as in a single process with the same seed. Shape queries answer with
the true shape (`nn.init.kaiming_uniform_` needs fan-in). Any other read of a
partitioned parameter raises an error that says to wrap the code in
`GatheredParameters(..., modifier_rank=0)`. The mode is active only inside the
context, so training pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from zero3 import accelerator, comm, default_group
from zero3.config import Zero3Config, load_config
from zero3.partition.collectives import ParamGather, gather_full_fp32
from zero3.shard_mesh import ShardMesh
from zero3.partition.partitioner import Partitioner
from zero3.partition.sharded_param import ShardedParam

_SHAPE_QUERIES = {"dim", "ndimension", "size", "numel", "nelement", "__len__", "shape", "ndim"}
# Reads that depend only on dtype/device/autograd metadata, never on values.
_METADATA_PASSTHROUGH = {
    "data", "dtype", "device", "requires_grad", "requires_grad_", "is_leaf", "grad", "is_cuda", "is_cpu",
    "is_floating_point", "is_complex", "element_size", "new", "new_empty", "new_zeros", "new_ones",
    "new_full", "new_tensor", "layout", "is_sparse", "is_quantized", "is_meta", "get_device", "_is_view",
    "untyped_storage", "storage_offset", "is_contiguous", "stride", "__hash__", "__eq__" , "names",
    "_has_compatible_shallow_copy_type",  # module._apply asks it before `param.data = ...`
}
_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"}


# Attribute reads that make a view (and so could smuggle a write past the check).
_VIEW_PROPERTIES = {"T", "mT", "H", "mH", "real", "imag"}


def _func_name(func: Callable[..., Any]) -> tuple[str, bool]:
    """The function's name, and whether it is an attribute getter."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", name), name == "__get__"
    return name, False


class _PartitionedWriteMode(TorchFunctionMode):
    def __init__(self, init: "Init") -> None:
        super().__init__()
        self.init = init

    def _lookup(self, value: Any) -> ShardedParam | None:
        if not isinstance(value, torch.Tensor):
            return None
        with torch._C.DisableTorchFunction():  # plain answers, not the mode's true-shape ones
            if value.numel() != 0:
                return None
            return self.init.placeholders.get(value.untyped_storage().data_ptr())

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if self.init.paused:
            return func(*args, **kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        touched = [sp for sp in map(self._lookup, leaves) if sp is not None]
        if not touched:
            return func(*args, **kwargs)
        name, is_getter = _func_name(func)
        # torch.nn.init functions pass the tensor by keyword (`tensor=`).
        first = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
        target = self._lookup(first)
        if target is not None and name in _SHAPE_QUERIES:
            shape = target.shape
            if name in ("numel", "nelement"):
                return target.numel
            if name in ("dim", "ndimension", "ndim"):
                return len(shape)
            if name == "__len__":
                return shape[0]
            if name == "size" and (len(args) > 1 or "dim" in kwargs):
                return shape[args[1] if len(args) > 1 else kwargs["dim"]]
            return shape
        if name == "data" and func.__name__ == "__set__" and target is not None:
            if self._lookup(args[1]) is target:
                return None  # `param.data = param` (module._apply keeping a partitioned parameter): nothing
            # `param.data = value`: the new value becomes the shards.
            full = args[1].detach().to(self.init.device, torch.float32).clone()
            if full.shape != target.shape:
                raise RuntimeError(
                    f"zero3.Init: cannot assign a {tuple(full.shape)} tensor to the .data of "
                    f"{target.name} (shape {tuple(target.shape)})"
                )
            self._store(target, full)
            return None
        if name in _METADATA_PASSTHROUGH or (is_getter and name not in _VIEW_PROPERTIES):
            return func(*args, **kwargs)
        out_target = self._lookup(kwargs.get("out"))
        writes = (target is not None and (name.endswith("_") and not name.endswith("__") or name in _INPLACE_DUNDERS)) or out_target is not None
        if not writes:
            sp = touched[0]
            raise RuntimeError(
                f"zero3.Init: `{name}` reads parameter {sp.name} (shape {tuple(sp.shape)}), which was "
                "partitioned when its module's constructor finished. Wrap this code in "
                "`with zero3.GatheredParameters(params, modifier_rank=0):` to read or edit whole parameters."
            )
        return self._apply_write(func, args, kwargs, touched, target or out_target, first)

    def _store(self, written: ShardedParam, full: torch.Tensor) -> None:
        """Rank 0's new full value becomes every rank's shards (16-bit and fp32 seed)."""
        with torch.no_grad():
            assert self.init.gather is not None and self.init.gather.comm is not None
            self.init.gather.comm.broadcast(full, src=0)
            written.write_full(full)

    def _apply_write(self, func, args, kwargs, touched: list[ShardedParam], written: ShardedParam, first: Any):
        fulls: dict[int, torch.Tensor] = {}
        for sp in touched:
            if id(sp) not in fulls:
                fulls[id(sp)] = self.init.gather_fp32(sp)

        def swap(value: Any) -> Any:
            sp = self._lookup(value)
            return fulls[id(sp)] if sp is not None else value

        with torch.no_grad():
            func(*tree_map(swap, args), **tree_map(swap, kwargs))
        self._store(written, fulls[id(written)])
        # In-place functions return their target: the (still partitioned) parameter.
        return first if self._lookup(first) is written else kwargs.get("out")


class Init:
    """Partition parameters as modules are constructed.

    `config` (or DeepSpeed's `config_dict_or_path`) is the engine config (dict,
    JSON path, or Zero3Config); its precision picks the 16-bit dtype of the shards. `dtype` overrides it.
    `enabled=False` makes the context a no-op (the engine partitions later).

    DeepSpeed's other arguments: `module=m` partitions an already built module
    now (no `with` needed); an Init inside another does nothing (the outer one
    partitions); `remote_device`, `pin_memory` and `mem_efficient_linear` are
    accepted with no effect (the engine's offload_param tier places the shards
    at initialize; backward re-gathers what any module saved); `data_parallel_group`
    may be the default group only. Inside the context, `module.cpu()`,
    `.to(...)` and `.to_empty(...)` leave partitioned parameters as they are,
    and a module built on the meta device (`torch.nn.utils.skip_init`) is
    partitioned without its values: they come later, under
    `GatheredParameters(..., modifier_rank=0)` or from a checkpoint.
    """

    _active: list["Init"] = []

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: dict | str | None = None,
        config: dict | str | Zero3Config | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **unsupported: Any,
    ) -> None:
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(
                f"zero3.Init's first argument is `module` (DeepSpeed's order), got a {type(module).__name__}; "
                "pass the config as config=... or config_dict_or_path=..."
            )
        if unsupported:
            raise TypeError(
                f"zero3.Init does not take {sorted(unsupported)} (DeepSpeed's mpu, sequence and quantization "
                "arguments have no counterpart yet)"
            )
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"zero3.Init: remote_device={remote_device!r}: expected None, 'cpu' or 'nvme'")
        if data_parallel_group is not None and data_parallel_group is not torch.distributed.group.WORLD:
            raise ValueError(
                "zero3.Init partitions over the default process group; another data_parallel_group is not "
                "offered yet"
            )
        if config is not None and config_dict_or_path is not None:
            raise ValueError("pass the config as `config` or `config_dict_or_path` (DeepSpeed's name), not both")
        config = config if config is not None else config_dict_or_path
        cfg = load_config(config if config is not None else {})
        self.enabled = enabled
        # Disabled, the context builds nothing, so a device setting it cannot use is no error.
        self.device = accelerator.resolve_device(device) if enabled else torch.device("cpu")
        self.dtype = dtype or cfg.compute_dtype
        self.sanity_checks = cfg.zero_optimization.enable_sanity_checks
        self.placeholders: dict[int, ShardedParam] = {}
        self._constructing: set[int] = set()
        self._patched: list[tuple[type, Callable[..., None]]] = []
        self._orig_init_subclass: Any = None
        self._patched_init_functions: list[tuple[str, Callable[..., Any]]] = []
        self._mode: _PartitionedWriteMode | None = None
        self.gather: ParamGather | None = None
        self.partitioner: Partitioner | None = None
        self._nested = False  # inside another Init: this one does nothing (DeepSpeed's rule)
        self._original_apply: Callable[..., Any] | None = None
        self.paused = False  # see `paused_for_engine_build`
        if module is not None and enabled:
            with self:
                if not self._nested:
                    self._on_module_built(module)

    @classmethod
    @contextmanager
    def paused_for_engine_build(cls) -> Iterator[None]:
        """The active context (if any) intercepts nothing for a while: `zero3.initialize` called inside
        `with zero3.Init(...)` (DeepSpeed allows it) builds its engine over the shards as anywhere else, and
        nothing the build constructs is partitioned. Modules built after it are again."""
        active = cls._active[0] if cls._active else None
        if active is None or active.paused:
            yield
            return
        active.paused = True
        try:
            yield
        finally:
            active.paused = False

    # ---- constructor interception ---------------------------------------
    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_zero3_wrapped", False):
            return
        init_ctx = self

        def wrapped_init(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            key = id(module)
            outermost = key not in init_ctx._constructing
            init_ctx._constructing.add(key)
            try:
                original(module, *args, **kwargs)
            finally:
                if outermost:
                    init_ctx._constructing.discard(key)
            if outermost and not init_ctx.paused:
                init_ctx._on_module_built(module)

        wrapped_init._zero3_wrapped = True  # type: ignore[attr-defined]
        wrapped_init.__wrapped__ = original  # type: ignore[attr-defined]
        cls.__init__ = wrapped_init  # type: ignore[misc]
        self._patched.append((cls, original))

    def _on_module_built(self, module: nn.Module) -> None:
        # Descendants too: a parent constructor may have replaced a child's
        # parameter with a new, whole one (`self.fc.weight = nn.Parameter(...)`).
        assert self.partitioner is not None
        for sub in module.modules():
            unit = self.partitioner.partition_module(sub, type(sub).__name__)
            if unit is not None:
                unit.sanity_checks = self.sanity_checks
                for sp in unit.params:
                    self.placeholders[sp.placeholder.untyped_storage().data_ptr()] = sp

    def _patch_nn_init(self, mode: _PartitionedWriteMode) -> None:
        """Run `torch.nn.init.*_` on whole values when handed a partitioned parameter.

        Some of them (trunc_normal_) read the tensor between their in-place
        steps, so the per-operation path of the mode cannot serve them.
        """
        for fname in dir(nn.init):
            function = getattr(nn.init, fname)
            if fname.startswith("_") or not fname.endswith("_") or not callable(function):
                continue

            def patched(tensor: torch.Tensor, *args: Any, _function=function, **kwargs: Any) -> Any:
                sp = None if self.paused else mode._lookup(tensor)
                if sp is None:
                    return _function(tensor, *args, **kwargs)
                return mode._apply_write(_function, (tensor, *args), kwargs, [sp], sp, tensor)

            setattr(nn.init, fname, patched)
            self._patched_init_functions.append((fname, function))

    def gather_fp32(self, sp: ShardedParam) -> torch.Tensor:
        """The full fp32 value of a partitioned parameter (collective)."""
        assert self.gather is not None
        return gather_full_fp32(sp, self.gather, self.device)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        if Init._active:
            self._nested = True  # the outer context partitions what is built in this one
            return self
        accelerator.set_device(self.device)
        default_group.join_default_group(self.device)
        self.gather = ParamGather(ShardMesh.of_group(), comm.Communicator())
        self.partitioner = Partitioner(self.gather, self.device, self.dtype)

        stack = [nn.Module]
        while stack:
            cls = stack.pop()
            self._wrap(cls)
            stack.extend(cls.__subclasses__())
        init_ctx = self
        self._orig_init_subclass = nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls: type, **kwargs: Any) -> None:
            init_ctx._wrap(cls)

        nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        self._device_mode = torch.device(self.device)
        self._device_mode.__enter__()
        self._mode = _PartitionedWriteMode(self)
        self._patch_nn_init(self._mode)
        self._patch_module_apply(self._mode)
        self._mode.__enter__()
        Init._active.append(self)
        return self

    def _patch_module_apply(self, mode: _PartitionedWriteMode) -> None:
        """`module.cpu()`, `.to(...)`, `.to_empty(...)` (all `Module._apply`) keep partitioned parameters
        where zero3 put them, as DeepSpeed's Init does; everything else moves as usual."""
        original = nn.Module._apply
        self._original_apply = original

        def _apply(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            def keep_partitioned(tensor: torch.Tensor) -> torch.Tensor:
                return tensor if not self.paused and mode._lookup(tensor) is not None else fn(tensor)

            return original(module, keep_partitioned, *args, **kwargs)

        nn.Module._apply = _apply  # type: ignore[method-assign]

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.enabled or self._nested:
            return
        Init._active.remove(self)
        if self._original_apply is not None:
            nn.Module._apply = self._original_apply  # type: ignore[method-assign]
            self._original_apply = None
        assert self._mode is not None
        self._mode.__exit__(exc_type, exc, tb)
        self._device_mode.__exit__(exc_type, exc, tb)
        for fname, function in self._patched_init_functions:
            setattr(nn.init, fname, function)
        self._patched_init_functions.clear()
        for cls, original in reversed(self._patched):
            cls.__init__ = original  # type: ignore[misc]
        self._patched.clear()
        if self._orig_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._orig_init_subclass  # type: ignore[assignment]


class MiCS_Init(Init):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's `deepspeed.zero.MiCS_Init`: `zero3.Init` for a model trained with MiCS
    (`zero_optimization.mics_shard_size`).

    The same arguments as `Init` (DeepSpeed's `sequence_data_parallel_group` and `mpu` are refused, as
    there). Construction partitions over every rank, as `Init` does (a smaller share per rank than
    DeepSpeed's, which partitions within the shard group at once); `zero3.initialize` then gathers each
    parameter whole and partitions it within its MiCS shard group, one module at a time. With no
    `mics_shard_size` in the config this is `Init`.
    """
