#!/usr/bin/env python
"""By-hand offload benchmark: `engine.offload_states` / `reload_states` against plain file I/O.

Not a test: nothing here asserts on timings (it does assert on correctness: a
reloaded state that is not bit-exact stops the run, since a fast wrong answer
is worth nothing).

It builds one zero3 engine in this process (no launcher: a world of 1 on gloo)
around a stack of ``--layers`` ``nn.Linear(--hidden, --hidden)`` layers, bf16,
AdamW, ZeRO-3 with ``stage3_param_persistence_threshold: 0``; trains one step,
then runs one more forward + backward without a step so ``lp_grads`` holds
gradients. Then, per state (``engine.state_report()`` gives its bytes) and per
device:

* ``nvme`` -- ``offload_states(include=[state], device="nvme", nvme_path=DIR)``
  then ``reload_states()``, each blocking call timed with ``time.perf_counter``;
  GB/s = bytes / wall seconds (GB = 1e9 bytes). In the same repeat, to the same
  directory, the plain sequential baseline for the same bytes: ONE
  ``open(path, "wb").write(memoryview)`` of a buffer of that size, then ONE
  ``readinto`` of a preallocated buffer; the file is deleted afterwards
  (untimed). ratio = ours / plain; the target is ratio >= 0.70. An "all" row
  (``include=None``) is compared with plain I/O of the summed bytes.
* ``cpu``  -- on a CPU engine the states already live in host memory, so this
  is a documented no-op: its time is reported, no GB/s.

``contiguous_grad_buffer`` is only freed and recreated (no I/O): its times are
reported, no GB/s and no ratio. Medians over ``--repeats`` (after ``--warmup``
untimed cycles); ours and the baseline alternate within each repeat.

Page cache: by default both sides go through it the same way (writes land in
it; reads of just-written bytes are served from it). ``--cold`` makes both
sides ``fsync`` and ``posix_fadvise(DONTNEED)`` the written files between
the write and the read, outside the timed region (for zero3: the files
``<buffer name>.bin`` under ``engine.offloader.disk.directory``), so the reads
come from the disk. The writes are timed without an fsync on both sides.

Also measured: ``offload_states(..., non_blocking=True)`` -- the time until the
call returns, and until ``zero3.get_state_devices(engine, state)`` returns
(it waits for the background writes).

    python benchmarks/offload.py                # defaults: ~30 s on a 2-core CPU
    python benchmarks/offload.py --cold         # reads from the disk, not the page cache
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import zero3
import zero3.offload.disk as zdisk
from zero3 import OffloadStateType
from zero3.cli import non_negative_int, positive_int

_REPO = Path(__file__).resolve().parent.parent
_RESULTS = _REPO / "benchmarks" / "results"
SCRATCH = OffloadStateType.contiguous_grad_buffer
IO_STATES = [s for s in OffloadStateType if s is not SCRATCH]
TARGET_RATIO = 0.70
ALL = "all"  # the include=None row


class CorrectnessError(AssertionError):
    """A reloaded state differs from what was offloaded."""


# --------------------------------------------------------------------- the engine


def build_config(micro_batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def build_engine(args: argparse.Namespace) -> Any:
    """The engine after one step and one more forward + backward (so lp_grads is non-zero)."""
    torch.manual_seed(args.seed)
    model = nn.Sequential(*(nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)))
    engine, _, _, _ = zero3.initialize(model=model, config=build_config(args.micro_batch))
    x = torch.randn(args.micro_batch, args.hidden)
    for i in range(2):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        if i == 0:
            engine.step()
    return engine


def state_buffers(engine: Any, state: OffloadStateType) -> list[Any]:
    """The FlatBuffers of a state (the engine's own accessor; the scratch bucket is the reducer's)."""
    if state is SCRATCH:
        return [engine.parts.reducer.scratch] if engine.parts.reducer.scratch is not None else []
    return engine.parts.state_buffers(state)


def io_bytes(report: dict[str, dict[str, int]], states: list[OffloadStateType]) -> int:
    return sum(sum(report[s.value].values()) for s in states if s is not SCRATCH)


def snapshot(engine: Any) -> dict[OffloadStateType, list[torch.Tensor]]:
    """Clones of every I/O state's buffers, taken before the first offload."""
    return {s: [b.tensor.clone() for b in state_buffers(engine, s)] for s in IO_STATES}


def verify(engine: Any, states: list[OffloadStateType], reference: dict[OffloadStateType, list[torch.Tensor]],
           scratch_nbytes: int, what: str) -> None:
    """Every reloaded buffer is torch.equal to its clone, and back in memory; raises CorrectnessError."""
    report = engine.state_report()
    for state in states:
        where = report[state.value]
        if state is SCRATCH:
            # Scratch holds nothing between backward passes: reload recreates it (same size), no data to compare.
            if where != {str(engine.device): scratch_nbytes}:
                raise CorrectnessError(f"{what}: contiguous_grad_buffer not recreated: state_report says {where}")
            continue
        if set(where) != {str(engine.device)}:
            raise CorrectnessError(f"{what}: {state.value} not back on {engine.device}: state_report says {where}")
        buffers = state_buffers(engine, state)
        if len(buffers) != len(reference[state]):
            raise CorrectnessError(f"{what}: {state.value} has {len(buffers)} buffers, {len(reference[state])} before")
        for buffer, ref in zip(buffers, reference[state]):
            got = buffer.tensor
            if got.dtype != ref.dtype or got.shape != ref.shape or not torch.equal(got, ref):
                bad = (got != ref).sum().item() if got.shape == ref.shape else "shape"
                raise CorrectnessError(
                    f"{what}: buffer {buffer.name!r} of {state.value} is NOT equal to its value before the "
                    f"first offload ({bad} elements differ)"
                )


def evict(paths: list[Path]) -> None:
    """fsync each file and drop its pages from the page cache (the --cold flush; never timed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def engine_files(engine: Any, states: list[OffloadStateType]) -> list[Path]:
    """The files a disk offload of `states` wrote: <buffer name>.bin in the engine's per-rank directory."""
    directory = engine.offloader.disk.directory
    if directory is None:
        raise RuntimeError("after offload_states(device='nvme') the engine has no disk directory")
    paths = [Path(directory) / f"{b.name}.bin" for s in states for b in state_buffers(engine, s)]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise RuntimeError(f"expected offload files not found: {missing} (in {sorted(os.listdir(directory))})")
    return paths


# ------------------------------------------------------------------- the measures


def median(values: list[float]) -> float:
    return statistics.median(values)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


class Plain:
    """The plain sequential baseline: one write() of a buffer, one readinto() of a preallocated buffer."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._bufs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if nbytes not in self._bufs:
            # Both touched (filled) here, so no page faults land in the timed calls.
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            dst = torch.zeros(nbytes, dtype=torch.uint8)
            self._bufs = {nbytes: (src, dst)}  # keep one size at a time
        return self._bufs[nbytes]

    def cycle(self, nbytes: int, cold: bool) -> tuple[float, float, float]:
        """(write s, read s, fresh-buffer read s) for one file of nbytes; the file is gone afterwards.

        The third is a diagnostic, not the baseline: the same readinto() into a buffer allocated
        (torch.empty) inside the timed region, as reload_states() must do, so it pays the page
        faults of fresh memory that the preallocated buffer has already paid.
        """
        src, dst = self._buffers(nbytes)
        path = self.directory / f"plain-{nbytes}.bin"
        try:
            view = memoryview(src.numpy())
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                written = f.write(view)
            t_write = time.perf_counter() - t0
            if written != nbytes:
                raise RuntimeError(f"plain write wrote {written} of {nbytes} bytes")
            if cold:
                evict([path])
            t_read = _timed_readinto(path, lambda: dst, nbytes, "plain readinto")
            if cold:
                evict([path])
            # The diagnostic: the buffer is allocated inside the timed region, as a reload must.
            t_fresh = _timed_readinto(
                path, lambda: torch.empty(nbytes, dtype=torch.uint8), nbytes, "plain readinto (fresh buffer)"
            )
        finally:
            path.unlink(missing_ok=True)
        return t_write, t_read, t_fresh


def _timed_readinto(path: Path, buffer: Callable[[], torch.Tensor], nbytes: int, what: str) -> float:
    """Seconds to get `buffer()` and fill it with one unbuffered readinto of `path`."""
    t0 = time.perf_counter()
    into = buffer()
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(memoryview(into.numpy()))
    seconds = time.perf_counter() - t0
    if got != nbytes:
        raise RuntimeError(f"{what} read {got} of {nbytes} bytes")
    return seconds


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_blocking(engine: Any, plain: Plain, label: str, states: list[OffloadStateType], device: str,
                 nbytes: int, args: argparse.Namespace, directory: Path,
                 reference: dict[OffloadStateType, list[torch.Tensor]], scratch_nbytes: int) -> dict[str, Any]:
    include = None if label == ALL else [states[0]]
    disk = device == "nvme"
    with_plain = disk and nbytes > 0
    row: dict[str, Any] = {"state": label, "device": device, "bytes": nbytes,
                           "offload_s": [], "reload_s": [], "plain_write_s": [], "plain_read_s": [],
                           "plain_read_fresh_buffer_s": []}
    for rep in range(args.warmup + args.repeats):
        t_off = timed(lambda: engine.offload_states(include=include, device=device, pin_memory=True,
                                                    non_blocking=False, nvme_path=str(directory)))
        report = engine.state_report()
        if disk and nbytes and io_bytes({k: {"nvme": v.get("nvme", 0)} for k, v in report.items()}, states) != nbytes:
            raise CorrectnessError(f"{label}: after offload_states(device='nvme') state_report says {dict(report)}")
        if SCRATCH in states and report[SCRATCH.value]:
            raise CorrectnessError(f"{label}: contiguous_grad_buffer not freed: {report[SCRATCH.value]}")
        if args.cold and disk and nbytes:
            evict(engine_files(engine, states))
        t_rel = timed(lambda: engine.reload_states(non_blocking=False))
        verify(engine, states, reference, scratch_nbytes, f"{label} -> {device}, repeat {rep}")
        if with_plain:
            t_w, t_r, t_f = plain.cycle(nbytes, args.cold)
        if rep < args.warmup:
            continue
        row["offload_s"].append(t_off)
        row["reload_s"].append(t_rel)
        if with_plain:
            row["plain_write_s"].append(t_w)
            row["plain_read_s"].append(t_r)
            row["plain_read_fresh_buffer_s"].append(t_f)

    row["offload_median_s"] = median(row["offload_s"])
    row["reload_median_s"] = median(row["reload_s"])
    noop = device == "cpu" and engine.device.type == "cpu"
    if label == SCRATCH.value:
        row["kind"] = "free"
    elif noop:
        row["kind"] = "noop"
    else:
        row["kind"] = "io"
    if row["kind"] == "io" and nbytes:
        # Median of per-repeat rates (the same as bytes / median time, up to interpolation).
        row["offload_gbps"] = median([gbps(nbytes, t) for t in row["offload_s"]])
        row["reload_gbps"] = median([gbps(nbytes, t) for t in row["reload_s"]])
    if with_plain:
        row["plain_write_gbps"] = median([gbps(nbytes, t) for t in row["plain_write_s"]])
        row["plain_read_gbps"] = median([gbps(nbytes, t) for t in row["plain_read_s"]])
        row["offload_ratio"] = row["offload_gbps"] / row["plain_write_gbps"]
        row["reload_ratio"] = row["reload_gbps"] / row["plain_read_gbps"]
        row["plain_read_fresh_buffer_gbps"] = median([gbps(nbytes, t) for t in row["plain_read_fresh_buffer_s"]])
    return row


def run_nonblocking(engine: Any, label: str, states: list[OffloadStateType], nbytes: int,
                    args: argparse.Namespace, directory: Path,
                    reference: dict[OffloadStateType, list[torch.Tensor]], scratch_nbytes: int) -> dict[str, Any]:
    """offload_states(non_blocking=True): until the call returns, and until get_state_devices returns."""
    include = None if label == ALL else [states[0]]
    returned: list[float] = []
    landed: list[float] = []
    for rep in range(args.warmup + args.repeats):
        t0 = time.perf_counter()
        engine.offload_states(include=include, device="nvme", pin_memory=True, non_blocking=True,
                              nvme_path=str(directory))
        t1 = time.perf_counter()
        devices = [zero3.get_state_devices(engine, s) for s in states]
        t2 = time.perf_counter()
        for s, d in zip(states, devices):
            expected = set() if s is SCRATCH else {torch.device("meta")}
            if d != expected:
                raise CorrectnessError(f"{label} non_blocking: get_state_devices({s.value}) = {d}, expected {expected}")
        engine.reload_states(non_blocking=False)
        verify(engine, states, reference, scratch_nbytes, f"{label} non_blocking, repeat {rep}")
        if rep >= args.warmup:
            returned.append(t1 - t0)
            landed.append(t2 - t0)
    return {
        "state": label, "bytes": nbytes, "return_s": returned, "written_s": landed,
        "return_median_s": median(returned), "written_median_s": median(landed),
        "written_gbps": median([gbps(nbytes, t) for t in landed]),
    }


# --------------------------------------------------------------------- reporting


def df_info(path: Path) -> dict[str, str]:
    try:
        out = subprocess.run(["df", "-PT", str(path)], capture_output=True, text=True, check=True).stdout
        fields = out.splitlines()[-1].split()
        return {"filesystem": fields[0], "type": fields[1], "size_kib": fields[2], "available_kib": fields[4],
                "mounted_on": fields[6], "df": out.strip()}
    except (OSError, subprocess.CalledProcessError, IndexError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def machine_info(directory: Path) -> dict[str, Any]:
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {
        "torch": torch.__version__,
        "zero3": zero3.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem,
        "directory": str(directory),
        "directory_fs": df_info(directory),
        "zero3.offload.disk.CHUNK_BYTES": zdisk.CHUNK_BYTES,
        "zero3.offload.disk.IO_THREADS": zdisk.IO_THREADS,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    flag = "" if value >= TARGET_RATIO else " [red](<0.70)[/red]"
    return f"{value:.2f}{flag}"


def print_report(results: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    s = results["setup"]
    table = Table(
        title=(
            f"offload_states / reload_states vs plain file I/O: {s['layers']} x Linear({s['hidden']}, {s['hidden']}), "
            f"bf16, AdamW, world 1, {'COLD (fsync + DONTNEED before reads)' if s['cold'] else 'page cache warm'}, "
            f"median of {s['repeats']} (+{s['warmup']} warmup), dir {s['directory_fs']}"
        ),
        caption="GB/s = 1e9 bytes / wall s of the blocking call; plain = one write() / one readinto() of the same "
        f"bytes in the same dir; ratio = ours / plain (target >= {TARGET_RATIO:.2f})",
    )
    for name in ("state", "device", "MiB", "offload GB/s", "plain write GB/s", "ratio",
                 "reload GB/s", "plain read GB/s", "ratio"):
        table.add_column(name, justify="left" if name in ("state", "device") else "right")
    for row in results["blocking"]:
        mib = f"{row['bytes'] / 2**20:.1f}"
        if row["kind"] == "noop":
            table.add_row(row["state"], row["device"], mib, _ms(row["offload_median_s"]), "-",
                          "no-op on a CPU engine", _ms(row["reload_median_s"]), "-", "no-op on a CPU engine")
        elif row["kind"] == "free":
            table.add_row(row["state"], row["device"], mib, f"freed {_ms(row['offload_median_s'])}", "-",
                          "no I/O", f"recreated {_ms(row['reload_median_s'])}", "-", "no I/O")
        else:
            table.add_row(
                row["state"], row["device"], mib,
                f"{row['offload_gbps']:.2f}", _num(row.get("plain_write_gbps")), _ratio(row.get("offload_ratio")),
                f"{row['reload_gbps']:.2f}", _num(row.get("plain_read_gbps")), _ratio(row.get("reload_ratio")),
            )
    console.print(table)

    times = Table(title="Median wall times of the same runs (ms)",
                  caption="plain read, fresh buf = diagnostic, not the baseline: readinto() a torch.empty buffer "
                  "allocated in the timed region (its page faults included), as a reload must")
    for name in ("state", "device", "MiB", "offload", "plain write", "reload", "plain read",
                 "plain read, fresh buf"):
        times.add_column(name, justify="left" if name in ("state", "device") else "right")
    for row in results["blocking"]:
        pw, pr, pf = row["plain_write_s"], row["plain_read_s"], row["plain_read_fresh_buffer_s"]
        times.add_row(row["state"], row["device"], f"{row['bytes'] / 2**20:.1f}",
                      f"{row['offload_median_s'] * 1e3:.2f}",
                      f"{median(pw) * 1e3:.2f}" if pw else "-",
                      f"{row['reload_median_s'] * 1e3:.2f}",
                      f"{median(pr) * 1e3:.2f}" if pr else "-",
                      f"{median(pf) * 1e3:.2f}" if pf else "-")
    console.print(times)

    if results["non_blocking"]:
        nb = Table(title="offload_states(device='nvme', non_blocking=True): medians",
                   caption="returns = until the call returns; written = until zero3.get_state_devices() returns "
                   "(it waits for the background writes); blocking = the blocking offload above")
        for name in ("state", "MiB", "returns ms", "written ms", "written GB/s", "blocking ms"):
            nb.add_column(name, justify="left" if name == "state" else "right")
        blocking = {r["state"]: r for r in results["blocking"] if r["device"] == "nvme"}
        for row in results["non_blocking"]:
            nb.add_row(row["state"], f"{row['bytes'] / 2**20:.1f}", f"{row['return_median_s'] * 1e3:.2f}",
                       f"{row['written_median_s'] * 1e3:.2f}", f"{row['written_gbps']:.2f}",
                       f"{blocking[row['state']]['offload_median_s'] * 1e3:.2f}" if row["state"] in blocking else "-")
        console.print(nb)

    below = [(r["state"], k, r[k]) for r in results["blocking"] for k in ("offload_ratio", "reload_ratio")
             if r.get(k) is not None and r[k] < TARGET_RATIO]
    if below:
        console.print(f"[bold red]below the {TARGET_RATIO:.2f} target:[/bold red] "
                      + ", ".join(f"{state} {k.split('_')[0]} {v:.2f} ({TARGET_RATIO - v:.2f} short)"
                                  for state, k, v in below))
    else:
        console.print(f"every nvme ratio is >= {TARGET_RATIO:.2f}")


# ------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Offload benchmark: zero3 engine.offload_states/reload_states (disk and cpu) against "
        "plain sequential file I/O of the same bytes in the same directory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--hidden", type=positive_int, default=2048, help="width of each nn.Linear")
    p.add_argument("--layers", type=positive_int, default=8,
                   help="nn.Linear layers (the defaults give ~512 MiB of model state: 16 bytes/param)")
    p.add_argument("--micro-batch", type=positive_int, default=4)
    p.add_argument("--repeats", type=positive_int, default=5, help="timed repeats per row (medians reported)")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed repeats first")
    p.add_argument("--devices", default="nvme,cpu", help="comma-separated subset of nvme, cpu")
    p.add_argument("--states", default=",".join([s.value for s in OffloadStateType] + [ALL]),
                   help="comma-separated rows: state names and/or 'all' (include=None, nvme only)")
    p.add_argument("--cold", action="store_true",
                   help="fsync + posix_fadvise(DONTNEED) the written files before each timed read "
                   "(ours and plain alike, untimed), so reads come from the disk, not the page cache")
    p.add_argument("--no-non-blocking", dest="non_blocking", action="store_false",
                   help="skip the non_blocking=True offload measurement (it runs by default)")
    p.add_argument("--dir", type=Path, default=None,
                   help="directory to offload into (a fresh subdirectory is made and removed); default: a temp "
                   "dir under /tmp")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results file (default: benchmarks/results/offload-<timestamp>.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    rows = [r.strip() for r in args.states.split(",") if r.strip()]
    valid = {s.value for s in OffloadStateType} | {ALL}
    bad = sorted(set(devices) - {"nvme", "cpu"}) + sorted(set(rows) - valid)
    if bad:
        print(f"unknown device(s)/state(s): {', '.join(bad)}", file=sys.stderr)
        return 2

    try:
        import deepspeed  # noqa: F401

        console.print(f"DeepSpeed {getattr(deepspeed, '__version__', '?')}: importable, but its "
                      "offload_states has no disk tier (device='cpu' only): nothing to compare on disk")
        ds_note = "importable; no disk tier for offload_states"
    except Exception as exc:  # ImportError, or a broken install
        console.print(f"DeepSpeed: not importable ({type(exc).__name__}: {exc})")
        ds_note = f"not importable ({type(exc).__name__}: {exc})"

    root = args.dir if args.dir is not None else Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="zero3-offload-bench-", dir=root))
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out if args.out is not None else _RESULTS / f"offload-{stamp}.json"

    engine = None
    started = time.perf_counter()
    try:
        console.print(f"building the engine ({args.layers} x Linear({args.hidden}, {args.hidden})) ...")
        engine = build_engine(args)
        report = engine.state_report()
        console.print(str(report), markup=False, highlight=False)
        state_bytes = {k: sum(v.values()) for k, v in report.items()}
        scratch_nbytes = state_bytes[SCRATCH.value]
        total_io = io_bytes(report, IO_STATES)
        free = shutil.disk_usage(directory).free
        if 2 * total_io > free:
            raise SystemExit(f"{directory}: {free} bytes free, {2 * total_io} needed")
        reference = snapshot(engine)

        setup = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                 "directory": str(directory), "zero3_config": build_config(args.micro_batch),
                 "state_bytes": state_bytes, "engine_device": str(engine.device), "deepspeed": ds_note}
        info = machine_info(directory)
        fs = info["directory_fs"]
        setup["directory_fs"] = f"{fs.get('type', '?')} on {fs.get('filesystem', '?')}"
        results: dict[str, Any] = {"setup": setup, "machine": info, "blocking": [], "non_blocking": []}
        plain = Plain(directory)
        for device in devices:
            for label in rows:
                if label == ALL and device != "nvme":
                    continue
                states = list(OffloadStateType) if label == ALL else [OffloadStateType(label)]
                nbytes = io_bytes(report, states)
                console.print(f"  {label} -> {device} ({nbytes / 2**20:.1f} MiB) ...")
                results["blocking"].append(run_blocking(engine, plain, label, states, device, nbytes, args,
                                                        directory, reference, scratch_nbytes))
        if args.non_blocking and "nvme" in devices:
            for label in rows:
                if label == SCRATCH.value:
                    continue
                states = list(OffloadStateType) if label == ALL else [OffloadStateType(label)]
                nbytes = io_bytes(report, states)
                console.print(f"  {label} -> nvme, non_blocking=True ...")
                results["non_blocking"].append(
                    run_nonblocking(engine, label, states, nbytes, args, directory, reference, scratch_nbytes))
        del plain
        results["wall_s"] = time.perf_counter() - started
        results["all_correct"] = True  # every reload was checked bit-exact (else CorrectnessError stopped the run)
    finally:
        if engine is not None:
            engine.destroy()
        shutil.rmtree(directory, ignore_errors=True)

    print_report(results, console)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    console.print(f"every reload bit-exact; {results['wall_s']:.0f} s; results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
