"""The configuration reference: docs/configuration.md's key tables, generated from the config models and
the key tables (keys.py)."""

from __future__ import annotations

import sys
from typing import Any

from pydantic import AliasChoices, BaseModel

from zero3.config.base import _show
from zero3.config.keys import CONFIG_KEYS, DEEPSPEED_KEYS, OPTIMIZER_TYPES, SCHEDULER_TYPES
from zero3.config.loading import load_config
from zero3.config.model import Zero3Config
from zero3.config.optimizer import TORCH_ELEMENTWISE, AdamConfig, LionConfig, MuonConfig
from zero3.config.scheduler import SchedulerConfig
from zero3.config.zero import _DEPRECATED_ZERO_KEYS

# [Note: the configuration reference]
# docs/configuration.md's key tables are `config_reference()`'s output, and a test keeps the page equal to
# it. Every key of Zero3Config's models has a row, with its default read from the models (an optimizer
# type's from a section that names only the type, so AdamW's weight decay of 0.01 shows) and what it does
# here: DEEPSPEED_KEYS' entry, else CONFIG_KEYS' (DeepSpeed's other keys, and zero3's own, whose fate is
# "zero3"). A key with neither entry, or an entry that names no key, fails the generator, so a key cannot
# be added undocumented. A sub-model's entry (`checkpoint`, `zero_optimization.offload_param`) is the
# sentence under its table's heading.


def _reference_default(field: Any) -> str:
    """A field's default as the user would write it in JSON (`5e8` for a round count of elements)."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value == sys.maxsize:
        return "no limit"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10**6:
        digits = str(value).rstrip("0")
        zeros = len(str(value)) - len(digits)
        if zeros >= 6 and len(digits) == 1:
            return f"`{digits}e{zeros}`"
    return f"`{_show(value)}`"


def _submodel(field: Any) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _config_sections() -> list[tuple[str, type[BaseModel]]]:
    """(path, model) of Zero3Config and each of its sections, a section before those nested in it."""
    found: list[tuple[str, type[BaseModel]]] = []

    def walk(path: str, model: type[BaseModel]) -> None:
        found.append((path, model))
        for name, field in model.model_fields.items():
            sub = _submodel(field)
            if sub is not None:
                walk(f"{path}.{name}" if path else name, sub)

    walk("", Zero3Config)
    return found


def config_key_paths() -> list[str]:
    """Every key path of the config's models (sections too), and DeepSpeed's deprecated ZeRO keys."""
    paths = [path for path, _ in _config_sections() if path]
    for section, model in _config_sections():
        paths += [f"{section}.{name}" if section else name for name, field in model.model_fields.items()
                  if _submodel(field) is None]
    return paths + [f"zero_optimization.{name}" for name in _DEPRECATED_ZERO_KEYS]


def _key_entry(path: str) -> tuple[str, str]:
    if path in DEEPSPEED_KEYS and path in CONFIG_KEYS:
        raise ValueError(f"config key {path} has an entry in both DEEPSPEED_KEYS and CONFIG_KEYS")
    entry = DEEPSPEED_KEYS.get(path) or CONFIG_KEYS.get(path)
    if entry is None:
        raise ValueError(f"config key {path} has no entry in DEEPSPEED_KEYS or CONFIG_KEYS: say what it does")
    return entry


def config_reference() -> str:
    """The Markdown tables of every config key, its default and what it does (docs/configuration.md)."""
    from typing import get_args

    stale = sorted((set(DEEPSPEED_KEYS) | set(CONFIG_KEYS)) - set(config_key_paths()))
    if stale:
        raise ValueError(f"DEEPSPEED_KEYS / CONFIG_KEYS name keys the config does not have: {stale}")
    header = ["| key | default | fate | what it does in zero3 |", "| --- | --- | --- | --- |"]
    out: list[str] = []
    for section, model in _config_sections():
        if section:
            fate, why = _key_entry(section)
            out += [f"### `{section}`", "", f"{fate}: {why}.", ""]
        else:
            out += ["### Top level", ""]
        out += header
        for name, field in model.model_fields.items():
            if _submodel(field) is not None:
                continue
            path = f"{section}.{name}" if section else name
            fate, why = _key_entry(path)
            short = name.removeprefix("stage3_")
            also = f" (also `{short}`)" if isinstance(field.validation_alias, AliasChoices) else ""
            out.append(f"| `{path}`{also} | {_reference_default(field)} | {fate} | {why} |")
        if section == "zero_optimization":
            for name in _DEPRECATED_ZERO_KEYS:
                fate, why = _key_entry(f"{section}.{name}")
                out.append(f"| `{section}.{name}` | - | {fate} | {why} |")
        out.append("")

    def params_text(model: type[BaseModel], values: dict[str, Any] | None = None) -> str:
        """Each parameter with its default (`values`' where given: a validated section's)."""
        shown = []
        for name, field in model.model_fields.items():
            if field.is_required():
                shown.append(f"`{name}` required")
            else:
                value = values[name] if values is not None else field.get_default(call_default_factory=True)
                shown.append(f"`{name}` `{_show(value)}`")
        return ", ".join(shown)

    out += ["### `optimizer` types", "", "| `type` | `params`, with their defaults | steps with |",
            "| --- | --- | --- |"]
    kinds: list[tuple[str, str, str]] = []
    for model in (AdamConfig, LionConfig, MuonConfig):
        for kind in get_args(model.model_fields["type"].annotation):
            params = load_config({"optimizer": {"type": kind}}).optimizer.params  # type: ignore[union-attr]
            kinds.append((kind, f"`{kind}`", params_text(type(params), params.model_dump())))
    torch_kinds = sorted(TORCH_ELEMENTWISE - {"Adam", "AdamW"})
    kinds.append(("torch", ", ".join(f"`{kind}`" for kind in torch_kinds), "its constructor's keyword arguments"))
    if {kind for kind, *_ in kinds} != set(OPTIMIZER_TYPES):
        raise ValueError(f"OPTIMIZER_TYPES must describe exactly {sorted(kind for kind, *_ in kinds)}")
    out += [f"| {names} | {params} | {OPTIMIZER_TYPES[kind]} |" for kind, names, params in kinds]
    out += ["", "### `scheduler` types", "", "| `type` | `params`, with their defaults | what it does |",
            "| --- | --- | --- |"]
    schedulers = get_args(get_args(SchedulerConfig)[0])
    scheduler_kinds = [get_args(model.model_fields["type"].annotation)[0] for model in schedulers]
    if set(scheduler_kinds) != set(SCHEDULER_TYPES):
        raise ValueError(f"SCHEDULER_TYPES must describe exactly {sorted(scheduler_kinds)}")
    for kind, model in zip(scheduler_kinds, schedulers):
        out.append(f"| `{kind}` | {params_text(model.model_fields['params'].annotation)} | {SCHEDULER_TYPES[kind]} |")
    return "\n".join(out) + "\n"
