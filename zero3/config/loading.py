"""Loading: reading a config file, validating it, and turning every pydantic error into one readable
``ConfigError``."""

from __future__ import annotations

import copy
import difflib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, ValidationError

from zero3.config.base import ConfigError, _KeyedError, _Model, _show
from zero3.config.model import Zero3Config
from zero3.config.optimizer import _UNION_TAGS
from zero3.config.zero import _DEPRECATED_ZERO_KEYS


def _key_path(loc: tuple[int | str, ...], data: Any) -> list[str]:
    """The user-facing key path of a pydantic error location.

    Pydantic puts the tag of a discriminated union (e.g. "WarmupCosineLR") into
    the location; it is not a key the user wrote, so it is dropped by walking
    the input alongside the location.
    """
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(node, dict) and item not in node and (node.get("type") == item or item in _UNION_TAGS):
            continue
        parts.append(f"[{item}]" if isinstance(item, int) else str(item))
        if isinstance(node, dict):
            node = node.get(item)
        elif isinstance(node, list) and isinstance(item, int) and item < len(node):
            node = node[item]
        else:
            node = None
    return parts


def _join(parts: list[str]) -> str:
    return ".".join(parts).replace(".[", "[")


def _format_errors(error: ValidationError, data: Any) -> str:
    lines: list[str] = []
    for err in error.errors():
        parts = _key_path(err["loc"], data)
        kind = err["type"]
        ctx = err.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, _KeyedError):
            keys = ", ".join(_join(parts + k.split(".")) for k in cause.keys)
            got = ", ".join(_show(v) for v in cause.values)
            lines.append(f"{keys}: {cause.message} (got {got})")
            continue
        if kind in ("union_tag_invalid", "union_tag_not_found"):
            # The discriminator key itself is what is wrong or missing.
            discriminator = str(ctx.get("discriminator", "type")).strip("'")
            key = _join(parts + ["type" if "(" in discriminator else discriminator])  # a callable's: the type
            if kind == "union_tag_not_found":
                lines.append(f"{key}: required key is missing")
            else:
                expected = ctx.get("expected_tags", "")
                # ctx["tag"] is str() of the value; show what the user wrote.
                node = err["input"]
                tag = node.get(key.rsplit(".", 1)[-1]) if isinstance(node, dict) else ctx.get("tag")
                lines.append(f"{key}: expected one of {expected} (got {_show(tag)})")
            continue
        key = _join(parts) or "<config>"
        message = err["msg"].removeprefix("Value error, ")
        if kind == "missing":
            lines.append(f"{key}: required key is missing")
        elif kind == "extra_forbidden":
            close = difflib.get_close_matches(parts[-1] if parts else key, _known_keys(), n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"{key}: unknown key (got {_show(err['input'])}){hint}")
        else:
            lines.append(f"{key}: {message} (got {_show(err['input'])})")
    count = len(lines)
    header = f"invalid zero3 config ({count} error{'s' if count != 1 else ''}):"
    return "\n".join([header, *("  " + line for line in lines)])


def _known_keys() -> list[str]:
    """Every key name some config model accepts (its field names and aliases), for "did you mean"."""
    names: set[str] = set(_DEPRECATED_ZERO_KEYS)
    models: list[type[BaseModel]] = [_Model]
    while models:
        model = models.pop()
        models.extend(model.__subclasses__())
        for name, field in model.model_fields.items():
            names.add(name)
            if isinstance(field.validation_alias, AliasChoices):
                names.update(choice for choice in field.validation_alias.choices if isinstance(choice, str))
    return sorted(names)


def _auto_values(data: Any, path: str = "") -> list[str]:
    """The keys holding "auto": the Hugging Face template's placeholders, which its integration fills."""
    if isinstance(data, dict):
        return [found for key, value in data.items() for found in _auto_values(value, f"{path}.{key}" if path else key)]
    if isinstance(data, list):
        return [found for i, value in enumerate(data) for found in _auto_values(value, f"{path}[{i}]")]
    return [path] if data == "auto" else []


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON config file's object, unvalidated (ConfigError naming the file if it cannot be read as one)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a JSON object (got {type(data).__name__})")
    return data


def load_config(config: dict[str, Any] | str | os.PathLike[str] | Zero3Config) -> Zero3Config:
    """Build a validated ``Zero3Config`` from a dict, a JSON file path, or a config.

    Raises ``ConfigError`` for a missing/unreadable file, bad JSON, or any
    invalid key or value. The input dict is never modified.
    """
    if isinstance(config, Zero3Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        data = read_config_file(config)
    elif isinstance(config, dict):
        # Deep copy: validation must never alias or alter the caller's nested dicts.
        data = copy.deepcopy(config)
    else:
        raise ConfigError(
            "config must be a dict, a path to a JSON file, or a Zero3Config "
            f"(got {type(config).__name__})"
        )
    auto = _auto_values(data)
    if auto:
        raise ConfigError(
            f"invalid zero3 config: {', '.join(auto)} {'is' if len(auto) == 1 else 'are'} \"auto\", the Hugging Face "
            "template's placeholder, which its DeepSpeed integration fills from the Trainer's arguments; it reached "
            "zero3 unfilled: write the value itself"
        )
    try:
        return Zero3Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, data)) from None
