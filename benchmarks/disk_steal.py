#!/usr/bin/env python
"""By-hand: how much CPU this machine's disk writes and unlinks cost it, counting what a hypervisor takes.

On a VM the host does the disk's work (the virtual disk's emulation, its discards) on host threads that may
run on the cores this VM's vCPUs run on; the guest sees that time as `steal` in /proc/stat, and only when
its CPUs wanted to run. So each case runs twice: with the machine otherwise idle, and with every core kept
busy by a spinning process (as training keeps them). Per case: `--gib` GiB written with O_DIRECT in chunks
of each `--chunks-kib`, fsynced, then unlinked; the machine's CPU time by kind over each (GB = 1e9 bytes).
Not a test: nothing asserts on timings. What the figures explain: benchmarks/checkpoint.py --overhead
(docs/benchmarks.md, "Where the rest goes").

    python benchmarks/disk_steal.py --dir /tmp --out /tmp/disk_steal.json     # about a minute here
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from provenance import write_run  # benchmarks/provenance.py, beside this script

KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_ticks() -> list[int]:
    with open("/proc/stat") as stat:
        return [int(field) for field in stat.readline().split()[1 : 1 + len(KINDS)]]


def spent_s(start: list[int], end: list[int]) -> dict[str, float]:
    hz = os.sysconf("SC_CLK_TCK")
    return {kind: (b - a) / hz for kind, a, b in zip(KINDS, start, end)}


def spin() -> None:
    while True:
        pass


def one_case(directory: Path, total: int, chunk: int) -> dict[str, Any]:
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(chunk))
    path = directory / f"disk_steal.{os.getpid()}.{chunk}"
    before, started = cpu_ticks(), time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for _ in range(total // chunk):
            os.write(fd, buffer)
        os.fsync(fd)
    finally:
        os.close(fd)
    written_s, after_write = time.perf_counter() - started, cpu_ticks()
    started = time.perf_counter()
    path.unlink()
    unlinked_s, after_unlink = time.perf_counter() - started, cpu_ticks()
    return {"chunk_kib": chunk >> 10, "write_wall_s": written_s, "write_cpu_s": spent_s(before, after_write),
            "unlink_wall_s": unlinked_s, "unlink_cpu_s": spent_s(after_write, after_unlink)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the file is written (the disk measured)")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--chunks-kib", default="128,1024,8192,32768")
    parser.add_argument("--out", type=Path, default=Path("/tmp/disk_steal.json"))
    args = parser.parse_args()
    chunks = [int(kib) << 10 for kib in args.chunks_kib.split(",")]
    total = int(args.gib * (1 << 30))
    rows: list[dict[str, Any]] = []
    for busy in (False, True):
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(os.cpu_count() or 1)] if busy else []
        for spinner in spinners:
            spinner.start()
        try:
            for chunk in chunks:
                rows.append({"cores_busy": busy, **one_case(args.dir, total // chunk * chunk, chunk)})
        finally:
            for spinner in spinners:
                spinner.kill()
    gb = total / 1e9
    print(f"{args.gib:g} GiB with O_DIRECT into {args.dir}: CPU seconds per GB (steal: the hypervisor's)")
    print(f"{'cores':>6} {'chunk KiB':>9} {'MB/s':>6} {'write steal':>11} {'write sys':>9} {'unlink s':>8} "
          f"{'unlink steal':>12}")
    for row in rows:
        write, unlink = row["write_cpu_s"], row["unlink_cpu_s"]
        print(f"{'busy' if row['cores_busy'] else 'idle':>6} {row['chunk_kib']:>9} {gb * 1e3 / row['write_wall_s']:>6.0f} "
              f"{write['steal'] / gb:>11.2f} {write['system'] / gb:>9.2f} {row['unlink_wall_s'] / gb:>8.2f} "
              f"{unlink['steal'] / gb:>12.2f}")
    write_run(args.out, "disk_steal", args, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
