"""The `optimizer` section: DeepSpeed's Adam family, Lion, Muon, or an elementwise torch.optim class."""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Literal

import torch
from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from zero3.config.base import _KeyedError, _Model

_ADAM_TYPES = ("Adam", "AdamW")
# zero3's own optimizer types; any other type names a torch.optim class.
_OWN_TYPES = (*_ADAM_TYPES, "Lion")
# torch.optim classes whose update is elementwise (LBFGS, SparseAdam, Adafactor and Muon are not).
TORCH_ELEMENTWISE = frozenset(
    {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adadelta"}
)


class OptimizerParams(_Model):
    lr: float = Field(default=1e-3, gt=0)
    # strict=False only so a JSON list is accepted for the tuple; the items are
    # still strict floats.
    betas: Annotated[tuple[float, float], Field(strict=False)] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    # The type-dependent default (0.01 for AdamW) is filled in by OptimizerConfig.
    weight_decay: float = Field(default=0.0, ge=0)
    # DeepSpeed picks torch's Adam over its fused kernel with this; zero3 always
    # uses torch's implementation, so it is accepted and ignored.
    torch_adam: bool = False
    adam_w_mode: bool | None = None

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        for beta in betas:
            if not 0.0 <= beta < 1.0:
                raise ValueError("each beta must be in [0, 1)")
        return betas


class AdamConfig(_Model):
    """DeepSpeed's Adam and AdamW (its "Adam" decouples weight decay unless adam_w_mode is false)."""

    type: Literal["Adam", "AdamW"]
    params: OptimizerParams = OptimizerParams()

    @model_validator(mode="before")
    @classmethod
    def _canonical_type_and_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)  # never mutate the caller's config
        kind = data.get("type")
        if isinstance(kind, str):
            canonical = {t.lower(): t for t in _ADAM_TYPES}.get(kind.lower())
            if canonical is None:
                raise _KeyedError(
                    ("type",),
                    f"unknown optimizer type; supported: {', '.join(_ADAM_TYPES)}",
                    (kind,),
                )
            data["type"] = canonical
            params = data.get("params")
            # torch.optim.AdamW defaults weight_decay to 0.01, Adam to 0.
            if canonical == "AdamW" and isinstance(params, dict) and "weight_decay" not in params:
                data["params"] = {**params, "weight_decay": 0.01}
            elif canonical == "AdamW" and "params" not in data:
                data["params"] = {"weight_decay": 0.01}
        return data

    @model_validator(mode="after")
    def _mode_consistent(self) -> AdamConfig:
        if self.type == "AdamW" and self.params.adam_w_mode is False:
            raise _KeyedError(
                ("params.adam_w_mode",),
                "AdamW always decouples weight decay; use type Adam for L2-style decay",
                (False,),
            )
        return self

    @property
    def decoupled_weight_decay(self) -> bool:
        """Whether to apply AdamW-style (decoupled) weight decay.

        DeepSpeed's ``"Adam"`` is AdamW unless ``adam_w_mode`` is false, so a
        DeepSpeed config keeps its meaning here.
        """
        if self.type == "AdamW":
            return True
        return True if self.params.adam_w_mode is None else self.params.adam_w_mode


def _named(data: Any, canonical: str) -> Any:
    """The section with its `type` spelled as zero3 does (the type is matched case-insensitively)."""
    if isinstance(data, dict) and isinstance(data.get("type"), str):
        data = {**data, "type": canonical}
    return data


class LionParams(_Model):
    lr: float = Field(default=1e-4, gt=0)
    betas: Annotated[tuple[float, float], Field(strict=False)] = (0.9, 0.99)
    weight_decay: float = Field(default=0.0, ge=0)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        for beta in betas:
            if not 0.0 <= beta <= 1.0:
                raise ValueError("each beta must be in [0, 1]")
        return betas


class LionConfig(_Model):
    """zero3.optim.Lion: the sign of an interpolated momentum."""

    type: Literal["Lion"]
    params: LionParams = LionParams()

    _canonical_type = model_validator(mode="before")(classmethod(lambda cls, data: _named(data, "Lion")))


class MuonParams(_Model):
    # torch.optim.Muon's names and defaults, with DeepSpeed's muon_lr / adam_lr beside them.
    lr: float = Field(default=1e-3, gt=0)
    muon_lr: float | None = Field(default=None, gt=0)  # the matrices' lr (default: lr)
    adam_lr: float | None = Field(default=None, gt=0)  # every other parameter's AdamW lr (default: lr)
    momentum: float = Field(default=0.95, ge=0, lt=1)
    weight_decay: float = Field(default=0.1, ge=0)
    nesterov: bool = True
    ns_method: Literal["standard"] = "standard"  # torch's Newton-Schulz iteration
    ns_steps: int = Field(default=5, gt=0, lt=100)
    ns_coefficients: Annotated[tuple[float, float, float], Field(strict=False)] = (3.4445, -4.775, 2.0315)
    eps: float = Field(default=1e-7, gt=0)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None


class MuonConfig(_Model):
    """Muon for the hidden weight matrices, AdamW for every other parameter (zero3.optim.muon)."""

    type: Literal["Muon"]
    params: MuonParams = MuonParams()

    _canonical_type = model_validator(mode="before")(classmethod(lambda cls, data: _named(data, "Muon")))


def _torch_optimizer_names() -> dict[str, str]:
    return {
        name.lower(): name for name in dir(torch.optim)
        if isinstance(getattr(torch.optim, name), type) and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
        and name != "Optimizer"
    }


class TorchOptimizerConfig(_Model):
    """Any other type names a torch.optim class (as in DeepSpeed), with its constructor's keyword
    arguments as `params`; its update must be elementwise (see zero3.optim.spec)."""

    type: str
    params: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _torch_class_and_arguments(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kind = data.get("type")
        if not isinstance(kind, str):
            return data
        canonical = _torch_optimizer_names().get(kind.lower())
        if canonical is None:
            raise _KeyedError(
                ("type",),
                f"unknown optimizer type; zero3's own: {', '.join((*_OWN_TYPES, 'Muon'))}; or a torch.optim class",
                (kind,),
            )
        if canonical not in TORCH_ELEMENTWISE:
            raise _KeyedError(
                ("type",),
                f"torch.optim.{canonical} is not elementwise: zero3 steps each rank's shard of a parameter on its "
                f"own (elementwise torch types: {', '.join(sorted(TORCH_ELEMENTWISE))})",
                (kind,),
            )
        params = data.get("params", {})
        if not isinstance(params, dict):
            return data  # the field's own error
        optimizer_cls = getattr(torch.optim, canonical)
        accepted = [name for name in inspect.signature(optimizer_cls.__init__).parameters if name not in ("self", "params")]
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            raise _KeyedError(
                tuple(f"params.{key}" for key in unknown),
                f"not an argument of torch.optim.{canonical} (its arguments: {', '.join(accepted)})",
                tuple(params[key] for key in unknown),
            )
        params = {key: tuple(value) if isinstance(value, list) else value for key, value in params.items()}
        try:
            optimizer_cls([torch.zeros(1, requires_grad=True)], **params)
        except (ValueError, TypeError, RuntimeError) as error:
            raise _KeyedError(("params",), f"torch.optim.{canonical} refuses them: {error}", (params,)) from None
        return {**data, "type": canonical, "params": params}


def _optimizer_kind(data: Any) -> str | None:
    kind = data.get("type") if isinstance(data, dict) else getattr(data, "type", None)
    if not isinstance(kind, str):
        return None
    lowered = kind.lower()
    if lowered in ("adam", "adamw"):
        return "adam"
    if lowered in ("lion", "muon"):
        return lowered
    return "torch"


_UNION_TAGS = frozenset({"adam", "lion", "muon", "torch"})

# The `optimizer` section: by its `type`, DeepSpeed's Adam family, Lion, Muon, or a torch.optim class.
OptimizerConfig = Annotated[
    Annotated[AdamConfig, Tag("adam")] | Annotated[LionConfig, Tag("lion")] | Annotated[MuonConfig, Tag("muon")]
    | Annotated[TorchOptimizerConfig, Tag("torch")],
    Discriminator(_optimizer_kind),
]
