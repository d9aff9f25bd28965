"""`deepspeed.runtime`: the paths scripts import from (`zero`, `lr_schedules`)."""

from zero3.deepspeed.runtime import lr_schedules, zero

__all__ = ["lr_schedules", "zero"]
