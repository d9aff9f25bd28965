"""The `checkpoint` section: DeepSpeed's keys and zero3's automatic checkpoints."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from zero3.config.base import _KeyedError, _Model

_ValidationMode = Annotated[
    Literal["IGNORE", "WARN", "FAIL"], BeforeValidator(lambda value: value.upper() if isinstance(value, str) else value)
]


class CheckpointConfig(_Model):
    """The `checkpoint` section: DeepSpeed's keys (accepted; DEEPSPEED_KEYS says what each does here) and
    zero3's automatic checkpoints (`engine.step` saves every `interval_steps`, `zero3.initialize` resumes:
    zero3.engine.checkpoints' `_save_on_interval` and `resume_from_config`)."""

    # zero3's: save every `interval_steps` optimizer steps into `dir`, keep the newest `keep_last` complete
    # tags, write in the background with `async_save`, and start from the newest one with `resume`.
    dir: str | None = None
    interval_steps: int | None = Field(default=None, gt=0)
    async_save: bool = False
    keep_last: int | None = Field(default=None, gt=0)
    resume: bool = False
    # DeepSpeed's.
    tag_validation: _ValidationMode = "WARN"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: dict[str, Any] | None = None
    checkpoint_serialization: bool = True
    writer: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _dir_where_needed(self) -> CheckpointConfig:
        for key in ("interval_steps", "resume", "keep_last", "async_save"):
            if key in self.model_fields_set and getattr(self, key) not in (None, False) and self.dir is None:
                raise _KeyedError((key,), "needs checkpoint.dir, the directory the checkpoints live in",
                                  (getattr(self, key),))
        if self.dir is not None and not self.dir.strip():
            raise _KeyedError(("dir",), "expected a directory path", (self.dir,))
        if self.load_universal:
            raise _KeyedError(("load_universal",), "zero3 loads its own checkpoints at any world size with no "
                              "conversion; DeepSpeed's universal checkpoints are not read (use false)", (True,))
        return self

    @property
    def automatic(self) -> bool:
        """Whether the engine saves by itself (every interval_steps)."""
        return self.dir is not None and self.interval_steps is not None
