"""Offloading training state off the device: to host memory and to disk."""

from __future__ import annotations

from typing import Protocol

import torch

from zero3.enums import OffloadStateType


class StateHolder(Protocol):
    """What `get_state_devices` asks of an engine."""

    def state_devices(self, state: OffloadStateType | str) -> set[torch.device]: ...


def get_state_devices(engine: StateHolder, state: OffloadStateType | str) -> set[torch.device]:
    """The devices whose memory holds `state`.

    One device normally; `{torch.device("meta")}` for a state parked on disk
    (memory holds none of it); the empty set for a freed scratch bucket.
    """
    return engine.state_devices(state)
