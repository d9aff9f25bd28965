"""`deepspeed.zero`: the same module as `deepspeed.runtime.zero` (DeepSpeed binds one to the other)."""

from zero3.deepspeed.runtime.zero import *  # noqa: F403 - the one module's names, under its second path
from zero3.deepspeed.runtime.zero import __all__  # noqa: F401
