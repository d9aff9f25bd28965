"""What every config model shares: the error types, the strict `_Model` base and the common validators."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


class ConfigError(ValueError):
    """An invalid zero3 / DeepSpeed configuration."""


class _KeyedError(ValueError):
    """A validator error that names its own keys (relative to where it is raised).

    Pydantic locates a model-validator error at the model, not at the fields it
    is about; ``_format_errors`` uses ``keys`` to print the real key paths.
    """

    def __init__(self, keys: tuple[str, ...], message: str, values: tuple[Any, ...]) -> None:
        super().__init__(message)
        self.keys = keys
        self.message = message
        self.values = values


def _whole_number(value: Any) -> Any:
    # DeepSpeed configs write sizes as 5e8, which JSON parses as a float; accept
    # it when it is a whole number, but never truncate 1.5 to 1.
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise ValueError("expected a whole number")
    return value


def _never_if_infinite(value: Any) -> Any:
    # float("inf") (JSON's Infinity) is how accelerate turns DeepSpeed's progress line off.
    if isinstance(value, float) and value == math.inf:
        return None
    return _whole_number(value)


# Integer byte/element counts that may be written as whole floats (5e8).
_Size = Annotated[int, BeforeValidator(_whole_number)]


class _Model(BaseModel):
    # strict: no str->int or bool->int coercion (ints are still accepted for
    # floats); allow_inf_nan=False because Python's json accepts NaN/Infinity.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _none_as_empty(value: Any) -> Any:
    # DeepSpeed allows "offload_param": null; treat it as "no offload" so the
    # engine never has to test for None.
    return {} if value is None else value


def _show(value: Any) -> str:
    # JSON spelling (true, null, "text") because the user wrote JSON.
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
