#!/usr/bin/env python
"""By-hand benchmark: ZeRO++'s block quantize / dequantize (zero3.partition.quantize) beside the device's
memory bandwidth (issue 41's target on a GPU: at least half of it).

Not a test: nothing here asserts. For each size, times `BlockQuantizer.quantize` (bf16 in, codes and scales
out) and `dequantize` (back to bf16) at int8 and int4, and a plain device-to-device copy of the same bf16
tensor (the bandwidth a memory-bound kernel can reach: read + write). Throughput counts the bytes each
kernel must move at the least: bf16 values read plus encoded bytes written (quantize), or the reverse
(dequantize). Medians over `--repeats` timed runs after warmup.

    python benchmarks/quantize_throughput.py --device cuda --json /tmp/quantize_cuda.json
    python benchmarks/quantize_throughput.py --device cpu --sizes 16M      # here, for a look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from zero3.estimate import parse_count
from zero3.partition.quantize import BlockQuantizer

GB = 1e9


def timed(device: torch.device, run: Callable[[], None], repeats: int) -> float:
    """Median seconds of `run` (synchronised on a GPU)."""
    for _ in range(3):
        run()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(numel: int, device: torch.device, repeats: int) -> dict[str, float]:
    values = torch.randn(numel, device=device).to(torch.bfloat16)
    copy_out = torch.empty_like(values)
    row: dict[str, float] = {"numel": numel}
    copy_s = timed(device, lambda: copy_out.copy_(values), repeats)
    row["copy_GBps"] = 2 * values.numel() * 2 / copy_s / GB
    for bits in (8, 4):
        quantizer = BlockQuantizer(bits=bits)
        encoded = torch.empty(quantizer.encoded_bytes(numel), dtype=torch.uint8, device=device)
        decoded = torch.empty_like(values)
        moved = values.numel() * 2 + encoded.numel()
        quantize_s = timed(device, lambda: quantizer.quantize(values, encoded), repeats)
        dequantize_s = timed(device, lambda: quantizer.dequantize(encoded, numel, decoded), repeats)
        row[f"int{bits}_quantize_GBps"] = moved / quantize_s / GB
        row[f"int{bits}_dequantize_GBps"] = moved / dequantize_s / GB
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default="16M,64M,256M", help="elements per tensor, comma-separated")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "quantize.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import write_run  # benchmarks/provenance.py, beside this script

    device = torch.device(args.device)
    rows = [measure(parse_count(size), device, args.repeats) for size in args.sizes.split(",")]
    columns = ["copy_GBps", "int8_quantize_GBps", "int8_dequantize_GBps", "int4_quantize_GBps", "int4_dequantize_GBps"]
    print(f"GB/s on {device} (bytes a kernel must move: bf16 in or out, plus the encoded bytes)")
    print(f"{'elements':>12} " + " ".join(f"{c.removesuffix('_GBps'):>16}" for c in columns) + f" {'worst/copy':>11}")
    for row in rows:
        worst = min(row[c] for c in columns[1:])
        print(f"{int(row['numel']):>12,} " + " ".join(f"{row[c]:16.1f}" for c in columns)
              + f" {worst / row['copy_GBps']:11.2f}")
    write_run(args.json, "quantize_throughput", args, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
