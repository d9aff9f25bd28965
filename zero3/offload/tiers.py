"""The offload tiers from the config (ZeRO-Offload / ZeRO-Infinity): checked, then built.

`offload_optimizer.device` puts the fp32 masters and moments on the host
("cpu") or in files ("nvme": any file); `offload_param.device` puts the 16-bit shards
there. Everything a tier does with the disk goes through the one FileIO engine
and the one HostBufferPool that parking (`offload_states`) uses too.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from zero3 import accelerator
from zero3.config import Zero3Config
from zero3.offload.disk import FileIO
from zero3.offload.host import HostBufferPool
from zero3.offload.optimizer_tier import DiskOptimizerStates, MemoryOptimizerStates, OptimizerStates
from zero3.offload.param_tier import DiskShardTier, HostShardSource, split_units
from zero3.partition.flat_buffer import FlatBuffer
from zero3.partition.unit import GatherUnit, ShardSource
from zero3.step_protocol import StepProtocol

log = logging.getLogger("zero3")


class TierConfigError(ValueError):
    """An offload tier the config asks for cannot work here; the message names the key."""


def check_tiers(config: Zero3Config, device: torch.device) -> None:
    """Bad tier settings fail here, before anything is built: the paths, pin_memory, ratio."""
    zc = config.zero_optimization
    for key, tier in (("offload_param", zc.offload_param), ("offload_optimizer", zc.offload_optimizer)):
        if tier.device == "none":
            continue
        if tier.pin_memory and not accelerator.supports_pinned_memory(device):
            log.warning(
                "zero_optimization.%s.pin_memory=true has no effect: pinned memory needs a CUDA device "
                "(this engine runs on %s)", key, device,
            )
        if tier.device == "nvme":
            assert tier.nvme_path is not None  # the config requires it
            check_writable_directory(f"zero_optimization.{key}.nvme_path", tier.nvme_path)
    ratio = zc.offload_optimizer.ratio
    if zc.offload_optimizer.device != "none" and ratio < 1:
        if device.type != "cpu":
            raise TierConfigError(
                f"zero_optimization.offload_optimizer.ratio={ratio}: partial optimizer offload is not supported "
                "yet on a GPU; use 1.0 (the whole optimizer state on the host)"
            )
        log.warning(
            "zero_optimization.offload_optimizer.ratio=%s has no effect on a CPU engine: the whole optimizer "
            "state goes to the %s tier", ratio, zc.offload_optimizer.device,
        )


def check_writable_directory(key: str, path: str) -> None:
    where = Path(path)
    if not where.exists():
        raise TierConfigError(f"{key}={path!r}: the directory does not exist (create it first)")
    if not where.is_dir():
        raise TierConfigError(f"{key}={path!r}: not a directory")
    try:
        handle, probe = tempfile.mkstemp(prefix=".zero3-probe-", dir=where)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise TierConfigError(f"{key}={path!r}: the directory is not writable ({error.strerror or error})") from None


def check_free_space(needs: dict[str, tuple[str, int]], protocol: StepProtocol | None = None) -> None:
    """`needs`: key -> (path, bytes) of this rank's tier files. Every rank's needs on one filesystem (one
    machine, one device id) add up, since ranks of a node usually share a disk; with the engine's
    `protocol` every rank learns every rank's verdict and raises the same TierConfigError. Fails before any
    file is written."""
    host = socket.gethostname()
    mine = [(host, os.stat(path).st_dev, key, path, nbytes) for key, (path, nbytes) in needs.items()]
    everyone = protocol.exchange(mine) if protocol is not None else [(0, mine)]
    by_disk: dict[tuple[str, int], list[tuple[int, str, str, int]]] = {}
    for rank, entries in everyone:
        for machine, device, key, path, nbytes in entries:
            by_disk.setdefault((machine, device), []).append((rank, key, path, nbytes))
    problem = None
    for (machine, device), entries in by_disk.items():
        if machine != host or not any(device == d for _, d, *_ in mine):
            continue  # another machine's disk: its own ranks check it
        needed = sum(nbytes for *_, nbytes in entries)
        free = shutil.disk_usage(next(path for m, d, _, path, _ in mine if d == device)).free
        if needed > free:
            ranks = sorted({rank for rank, *_ in entries})
            keys = sorted({f"{key}={path!r}" for _, key, path, _ in entries})
            whose = f"ranks {', '.join(map(str, ranks))} together" if len(ranks) > 1 else f"rank {ranks[0]}"
            problem = (
                f"too little free disk space for the offloaded states: {', '.join(keys)} need {human_bytes(needed)} "
                f"on one filesystem ({whose}), and {human_bytes(free)} are free. Nothing was written."
            )
            break
    found = protocol.problems(problem) if protocol is not None else [p for p in [problem] if p is not None]
    if found:
        raise TierConfigError(found[0])


def human_bytes(count: int) -> str:
    """Bytes in the largest unit that keeps the figure at least 1, three significant digits (never 0.00 GiB)."""
    if count < 1024:
        return f"{count} bytes"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.3g} {unit}"
    raise AssertionError("unreachable")


@dataclass
class ParamLayout:
    """The 16-bit shards' buffers (the `lp_params` state) and, with params on disk, the disk tier."""

    buffers: list[FlatBuffer]
    disk_tier: DiskShardTier | None


def consolidate_lp(
    units: list[GatherUnit], dtype: torch.dtype, device: torch.device, name: str = "lp_params",
    source: ShardSource | None = None,
) -> FlatBuffer:
    """Move these units' shards into ONE flat 16-bit buffer (part or all of the `lp_params` state);
    `source` brings each unit's shard to the compute device when the buffer is not there."""
    # Every element is copied below (the units' slots tile the buffer): no fill first.
    flat = FlatBuffer(name, torch.empty(sum(unit.shard_numel for unit in units), dtype=dtype, device=device),
                      state="lp_params")
    cursor = 0
    for unit in units:
        shards = [sp.lp_slot.read() for sp in unit.params]  # type: ignore[union-attr]
        unit.assign_lp(flat, cursor, source)
        torch._foreach_copy_([sp.lp_shard() for sp in unit.params], shards)
        cursor += unit.shard_numel
    return flat


def lay_out_params(
    config: Zero3Config, units: list[GatherUnit], dtype: torch.dtype, device: torch.device, disk: FileIO,
) -> ParamLayout:
    tier = config.zero_optimization.offload_param
    if tier.device == "none":
        return ParamLayout([consolidate_lp(units, dtype, device)], None)
    host = torch.device("cpu")
    if tier.device == "cpu":
        in_memory, on_disk = units, []
    else:
        in_memory, on_disk = split_units(units, tier.max_in_cpu)
    # Beside a GPU, a shard kept in host memory is copied in for its gather.
    host_source = HostShardSource(device) if device.type != "cpu" else None
    buffers = [consolidate_lp(in_memory, dtype, host, source=host_source)] if in_memory else []
    if tier.pin_memory and accelerator.supports_pinned_memory(device) and buffers:
        buffers[0].replace(buffers[0].tensor.pin_memory())
    disk_tier = None
    if on_disk:
        assert tier.nvme_path is not None
        disk_tier = DiskShardTier(
            disk, Path(tier.nvme_path), sum(unit.shard_numel for unit in on_disk), dtype, device,
            read_ahead=tier.buffer_count,
        )
        buffers.append(disk_tier.adopt(on_disk, "lp_params:disk"))  # each unit's source: the tier
    return ParamLayout(buffers, disk_tier)


def optimizer_states(
    config: Zero3Config, device: torch.device, disk: FileIO, pool: HostBufferPool,
) -> Callable[[tuple[str, ...], int, int], OptimizerStates]:
    """How the optimizer makes its fp32 states, given (their names, total elements, largest sub-group)."""
    tier = config.zero_optimization.offload_optimizer

    def make(names: tuple[str, ...], numel: int, largest_sub_group: int) -> OptimizerStates:
        if tier.device == "nvme":
            assert tier.nvme_path is not None
            return DiskOptimizerStates(
                names, numel, disk, pool, Path(tier.nvme_path), tier.buffer_count, largest_sub_group,
            )
        if tier.device == "cpu":
            pin = tier.pin_memory and accelerator.supports_pinned_memory(device)
            return MemoryOptimizerStates(names, numel, torch.device("cpu"), pin)
        return MemoryOptimizerStates(names, numel, device, pin=False)

    return make


def step_device(config: Zero3Config, device: torch.device) -> torch.device:
    """Where the optimizer steps: the host for ZeRO-Offload and for a disk tier (its windows are in host
    memory), else the device."""
    return torch.device("cpu") if config.zero_optimization.offload_optimizer.device in ("cpu", "nvme") else device


def grad_device(config: Zero3Config, device: torch.device) -> torch.device:
    """ZeRO-Offload keeps the reduced gradients beside the masters, on the host; else they stay on the device."""
    return torch.device("cpu") if config.zero_optimization.offload_optimizer.device == "cpu" else device


def disk_needs(
    config: Zero3Config, units: list[GatherUnit], dtype: torch.dtype, trainable_numel: int, optimizer_states: int,
) -> dict[str, tuple[str, int]]:
    """Bytes each disk tier will reserve: the parameter shards `max_in_cpu` leaves on disk (as
    `lay_out_params` splits them), the optimizer's `optimizer_states` fp32 states (the master
    and each elementwise state) in two generations."""
    zc = config.zero_optimization
    needs: dict[str, tuple[str, int]] = {}
    if zc.offload_param.device == "nvme":
        assert zc.offload_param.nvme_path is not None
        _, on_disk = split_units(units, zc.offload_param.max_in_cpu)
        lp_bytes = sum(unit.shard_numel for unit in on_disk) * dtype.itemsize
        needs["zero_optimization.offload_param.nvme_path"] = (zc.offload_param.nvme_path, lp_bytes)
    if zc.offload_optimizer.device == "nvme":
        assert zc.offload_optimizer.nvme_path is not None
        needs["zero_optimization.offload_optimizer.nvme_path"] = (
            zc.offload_optimizer.nvme_path, 2 * optimizer_states * 4 * trainable_numel,
        )
    return needs
