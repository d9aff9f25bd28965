"""Offloading training state off the device: to host memory and to disk."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zero3.enums import OffloadStateType

if TYPE_CHECKING:
    from zero3.runtime.engine import ZeroEngine


def get_state_devices(engine: "ZeroEngine", state: OffloadStateType | str) -> set[torch.device]:
    """The devices whose memory holds `state`.

    One device normally; `{torch.device("meta")}` for a state parked on disk
    (memory holds none of it); the empty set for a freed scratch bucket.
    """
    return engine.state_devices(state)
