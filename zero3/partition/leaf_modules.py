"""Leaf modules (DeepSpeed's `z3_leaf_module` family and the `leaf_module` config).

A leaf module's parameters, its descendants' included, are one gather unit: gathered when the leaf's
forward begins, released when it ends, prefetched as one. Its descendants get no hooks of their own.
DeepSpeed needs leaves for mixture-of-experts blocks, whose experts run only for the tokens routed to
them (a rank that skips an expert would otherwise skip its gather and hang the others); zero3's
lockstep gather walk already keeps such ranks in step, so here a leaf is about granularity: one
gather for a block of many small modules.

The flag is DeepSpeed's own attribute (`module._z3_leaf`), so code that sets or reads it directly
agrees with these functions. The engine reads it when it is built (`zero3.initialize`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from zero3.partition.sharded_param import sharded

FLAG = "_z3_leaf"


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether `module` is flagged as a leaf."""
    return bool(getattr(module, FLAG, False))


def z3_leaf_parameter(param: torch.Tensor) -> bool:
    """Whether `param` belongs to a leaf module's unit (known once the engine is built)."""
    sp = sharded(param)
    return sp is not None and sp.leaf


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(module: nn.Module, flag: bool) -> None:
    setattr(module, FLAG, bool(flag))


def _is_class(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_by_class(model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    if isinstance(classes, (str, type)) or not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf module classes must be a list of classes or class names, got {classes!r}")
    matched = [module for module in model.modules() if any(_is_class(module, c) for c in classes)]
    for module in matched:
        set_z3_leaf_module(module, flag)
    if not matched and raise_if_not_found:
        raise ValueError(f"no module of the classes {list(classes)} in the model")
    return matched


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of these classes (classes, or names: `Block` or `pkg.mod.Block`); returns them."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Iterable[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules with these `named_modules()` names; returns them and the names not found."""
    by_name = dict(model.named_modules())
    matched = [by_name[name] for name in module_names if name in by_name]
    missing = [name for name in module_names if name not in by_name]
    for module in matched:
        set_z3_leaf_module(module, flag)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing} in the model")
    return matched, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Iterable[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Flag the modules whose `named_modules()` names end with one of these; returns them and the
    suffixes that matched nothing."""
    matched: dict[int, nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        found = [module for name, module in model.named_modules() if name.endswith(suffix)]
        if not found:
            missing.append(suffix)
        for module in found:
            matched.setdefault(id(module), module)
    for module in matched.values():
        set_z3_leaf_module(module, flag)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules matching the suffixes {missing} in the model")
    return list(matched.values()), missing


def apply_leaf_module_config(model: nn.Module, classes: Sequence[str], names: Sequence[str],
                             name_suffixes: Sequence[str]) -> list[nn.Module]:
    """The config's `zero_optimization.leaf_module`: flag what it names (nothing found is no error, as
    in DeepSpeed: one config serves several models). Returns the modules flagged."""
    flagged: dict[int, nn.Module] = {}
    for module in _set_by_class(model, list(classes), True, False) if classes else []:
        flagged[id(module)] = module
    for module in set_z3_leaf_modules_by_name(model, names, True, False)[0]:
        flagged[id(module)] = module
    for module in set_z3_leaf_modules_by_suffix(model, name_suffixes, True, False)[0]:
        flagged[id(module)] = module
    return list(flagged.values())


def leaf_of(model: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each module inside a leaf (the outermost one), mapped to that leaf (a leaf maps to itself)."""
    inside: dict[nn.Module, nn.Module] = {}

    def visit(module: nn.Module, leaf: nn.Module | None) -> None:
        if leaf is None and z3_leaf_module(module):
            leaf = module
        if leaf is not None:
            inside[module] = leaf
        for child in module.children():
            visit(child, leaf)

    visit(model, None)
    return inside




# A leaf is gathered whole: one larger than this many elements would hold too much at once.
MAX_LEAF_NUMEL = 1_000_000_000


def set_leaves_by_granularity(model: nn.Module, threshold: int) -> list[nn.Module]:
    """`stage3_module_granularity_threshold` (DeepSpeed's rule): a module's granularity is its
    subtree's parameter elements per layer (each parameter-holding module without children is one
    layer, each other non-container module one more); top-down, the first module at or under
    `threshold` becomes a leaf. Containers (ModuleList, ...) are never leaves (their own forward may
    never run), nor modules without parameters or above MAX_LEAF_NUMEL elements."""
    granularity: dict[nn.Module, int] = {}

    def numel(param: torch.Tensor) -> int:
        sp = sharded(param)
        return sp.numel if sp is not None else param.numel()

    def measure(module: nn.Module) -> tuple[int, int]:
        """(layers, parameter elements) of the subtree."""
        own = sum(numel(p) for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            return (1, own) if own else (0, 0)
        layers, elements = 0, own
        for child in children:
            child_layers, child_elements = measure(child)
            layers += child_layers
            elements += child_elements
        if type(module).__name__ in nn.modules.container.__all__ or elements == 0:
            return layers, elements
        layers += 1
        if elements <= MAX_LEAF_NUMEL:
            granularity[module] = elements // layers
        return layers, elements

    measure(model)
    leaves: list[nn.Module] = []

    def choose(module: nn.Module) -> None:
        if module in granularity and granularity[module] <= threshold:
            set_z3_leaf_module(module, True)
            leaves.append(module)
            return
        for child in module.children():
            choose(child)

    choose(model)
    return leaves


def mark_leaves(model: nn.Module, classes: Sequence[str], names: Sequence[str], name_suffixes: Sequence[str],
                granularity_threshold: int) -> dict[nn.Module, nn.Module]:
    """The engine's leaves, marked before anything is partitioned: the config's `leaf_module`, then
    `stage3_module_granularity_threshold` where it is set; each module inside a leaf mapped to it (`leaf_of`)."""
    apply_leaf_module_config(model, classes, names, name_suffixes)
    if granularity_threshold > 0:
        set_leaves_by_granularity(model, granularity_threshold)
    return leaf_of(model)
