#!/usr/bin/env python
"""By-hand ZeRO-Infinity benchmark: train a GPT bigger than RAM with optimizer and parameters on disk.

Not a test: nothing here asserts on timings. One process, a world of 1
(gloo), AdamW, fp32 by default (``--precision bf16`` for 16-bit shards: on a
CPU without AVX-512 BF16, torch's bf16 matmul backward is ~30x slower than
fp32, which buries the I/O this measures). The model is built under ``zero3.Init`` (never whole in
memory); with ``--tier both_nvme`` (the default) the fp32 masters and Adam
moments live in files under ``--dir`` (two generations: see
zero3/offload/optimizer_tier.py) and the parameter shards too; only the
gradients stay in memory. At 16 bytes per parameter the default 1.78B-parameter
GPT needs 28.5 GB of training state (fp32: 20 bytes, 35.6 GB), more than this
machine's 24 GiB of RAM.

In the same run and the same directory, first, the plain sequential rate of
the disk: ONE ``write`` of ``--plain-gib`` GiB then ``fsync``, the page cache
dropped (``posix_fadvise(DONTNEED)``), then ONE ``readinto``, in a spawned
child process (its buffers stay out of this process's peak RSS), and again
after training; ratios use the mean of the two rates (both are printed: this
VM's disk drifts by up to 2x within a run). Then ``--steps``
training steps, each timed per phase (forward, backward, step) with the bytes
the engine's disk layer moved in that phase (``engine.parts.disk.bytes_read`` /
``bytes_written``). The I/O rate of a phase is its bytes over its wall time
(compute included: it is what the step sees); "plain" for the same mix of
reads and writes is bytes / (read bytes / plain read rate + written bytes /
plain write rate), and ratio = ours / plain (goal: >= 0.5). Peak RSS is
``ru_maxrss`` (the whole run, the model build included; goal: < 12 GiB).

    python benchmarks/tiers.py --dir /work/nvme              # 1.78B params, 3 steps: ~15-25 min here
    python benchmarks/tiers.py --dir /tmp/t --n-layer 2 --n-embd 256 --n-head 4 --vocab 4096   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import zero3
from zero3.models.gpt import GPT, GPTConfig

_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "tiers.json"
GB = 1e9


def tier_config(tier: str, root: str) -> dict[str, Any]:
    nvme = {"device": "nvme", "nvme_path": root}
    return {
        "none": {},
        "optimizer_cpu": {"offload_optimizer": {"device": "cpu"}},
        "optimizer_nvme": {"offload_optimizer": nvme},
        "params_nvme": {"offload_param": {**nvme, "max_in_cpu": 0}},
        "both_nvme": {"offload_optimizer": nvme, "offload_param": {**nvme, "max_in_cpu": 0}},
    }[tier]


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def rss_gib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 2**30
    return float("nan")


def plain_sequential(directory: Path, gib: float) -> dict[str, float]:
    """One write + fsync, the cache dropped, one read (looped past 2 GiB): the disk's plain rates (GB/s)."""
    nbytes = int(gib * 2**30)
    data = torch.ones(nbytes, dtype=torch.uint8)
    view = memoryview(data.numpy())
    path = directory / "plain-sequential.bin"
    started = time.perf_counter()
    with open(path, "wb") as out:
        out.write(view)
        out.flush()
        os.fsync(out.fileno())
    write_s = time.perf_counter() - started
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    into = torch.empty(nbytes, dtype=torch.uint8)
    started = time.perf_counter()
    read = 0
    target = memoryview(into.numpy())
    with open(path, "rb", buffering=0) as source:
        while read < nbytes:  # one read(2) returns at most 2 GiB - 4 KiB on Linux
            count = source.readinto(target[read:])
            if not count:
                break
            read += count
    read_s = time.perf_counter() - started
    path.unlink()
    assert read == nbytes and torch.equal(into[:4096], data[:4096])
    return {"bytes": nbytes, "write_GBps": nbytes / write_s / GB, "read_GBps": nbytes / read_s / GB}


def plain_in_child(directory: Path, gib: float) -> dict[str, float]:
    """`plain_sequential` in a spawned process, so its buffers do not count in this process's peak RSS."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(plain_sequential, (directory, gib))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="the disk tier's directory (default: a temp dir under /tmp)")
    parser.add_argument("--tier", default="both_nvme",
                        choices=["none", "optimizer_cpu", "optimizer_nvme", "params_nvme", "both_nvme"])
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--n-embd", type=int, default=2400)
    parser.add_argument("--n-head", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sub-group-size", type=float, default=5e7)
    parser.add_argument("--reduce-bucket-size", type=float, default=5e7,
                        help="zero_optimization.reduce_bucket_size (elements; the scratch bucket is this x 4 B in fp32)")
    parser.add_argument("--buffer-count", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=1 << 20, help="aio.block_size (bytes per request)")
    parser.add_argument("--queue-depth", type=int, default=8, help="aio.queue_depth")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--plain-gib", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, default=_DEFAULT_OUT)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
                      RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="zero3-tiers-"))
    root.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(root).free / GB

    before = plain_in_child(root, args.plain_gib)
    print(f"plain sequential on {root}: write {before['write_GBps']:.2f} GB/s, read {before['read_GBps']:.2f} GB/s "
          f"({args.plain_gib:g} GiB, fsync + dropped cache)", flush=True)

    model_cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                          n_embd=args.n_embd)
    params = model_cfg.num_parameters()
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "bf16": {"enabled": args.precision == "bf16"},
        "zero_optimization": {
            "stage": 3, "sub_group_size": int(args.sub_group_size),
            "reduce_bucket_size": int(args.reduce_bucket_size), **tier_config(args.tier, str(root)),
        },
        "aio": {"block_size": args.block_size, "queue_depth": args.queue_depth, "thread_count": 1},
        "steps_per_print": 1_000_000,
    }
    for key in ("offload_optimizer", "offload_param"):
        if key in config["zero_optimization"]:
            config["zero_optimization"][key]["buffer_count"] = args.buffer_count
    print(f"GPT {args.n_layer} x {args.n_embd}, vocab {args.vocab}: {params / 1e9:.3f}B parameters, "
          f"{16 * params / GB:.1f} GB of training state at 16 bytes/parameter; tier {args.tier}, "
          f"{args.precision}", flush=True)

    started = time.perf_counter()
    torch.manual_seed(0)
    with zero3.Init(config=config, device="cpu"):
        model = GPT(model_cfg)
    engine, *_ = zero3.initialize(model=model, config=config, device="cpu")
    init_s = time.perf_counter() - started
    init_peak = peak_rss_gib()
    print(f"built in {init_s:.1f} s; RSS {rss_gib():.2f} GiB, peak so far {init_peak:.2f} GiB", flush=True)
    print(engine.state_report(), flush=True)

    generator = torch.Generator().manual_seed(1)
    rows: list[dict[str, Any]] = []
    disk = engine.parts.disk
    for step in range(args.steps):
        idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        row: dict[str, Any] = {"step": step + 1}
        for phase in ("forward", "backward", "step"):
            read0, written0 = disk.bytes_read, disk.bytes_written
            begun = time.perf_counter()
            if phase == "forward":
                loss = engine(idx, idx)["loss"]
            elif phase == "backward":
                engine.backward(loss)
            else:
                engine.step()
            seconds = time.perf_counter() - begun
            read, written = disk.bytes_read - read0, disk.bytes_written - written0
            rate = (read + written) / seconds / GB
            row[phase] = {"s": seconds, "read_GB": read / GB, "written_GB": written / GB, "GBps": rate,
                          "peak_rss_GiB_so_far": peak_rss_gib()}
        row["loss"] = loss.item()
        row["s"] = sum(row[p]["s"] for p in ("forward", "backward", "step"))
        row["rss_GiB"] = rss_gib()
        rows.append(row)
        print(f"step {step + 1}: loss {row['loss']:.4f}, {row['s']:.1f} s "
              + ", ".join(f"{p} {row[p]['s']:.1f} s ({row[p]['read_GB'] + row[p]['written_GB']:.1f} GB, "
                          f"{row[p]['GBps']:.2f} GB/s)" for p in ("forward", "backward", "step"))
              + f"; RSS {row['rss_GiB']:.2f} GiB, peak so far "
              + "/".join(f"{row[p]['peak_rss_GiB_so_far']:.2f}" for p in ("forward", "backward", "step"))
              + " GiB after forward/backward/step", flush=True)
    engine.destroy()
    peak = peak_rss_gib()
    after = plain_in_child(root, args.plain_gib)
    print(f"plain sequential again: write {after['write_GBps']:.2f} GB/s, read {after['read_GBps']:.2f} GB/s",
          flush=True)
    plain = {key: (before[key] + after[key]) / 2 for key in ("write_GBps", "read_GBps")}
    for row in rows:
        for phase in ("forward", "backward", "step"):
            cell = row[phase]
            plain_s = cell["read_GB"] / plain["read_GBps"] + cell["written_GB"] / plain["write_GBps"]
            cell["ratio_to_plain"] = plain_s / cell["s"] if plain_s else None

    def median(phase: str, key: str) -> float:
        values = [row[phase][key] for row in rows if row[phase][key] is not None]
        return statistics.median(values) if values else float("nan")

    header = ("phase", "median s", "read GB", "written GB", "GB/s", "plain-equivalent", "ratio")
    table = [header]
    for phase in ("forward", "backward", "step"):
        ratio = median(phase, "ratio_to_plain")
        table.append((phase, f"{median(phase, 's'):.2f}", f"{median(phase, 'read_GB'):.2f}",
                      f"{median(phase, 'written_GB'):.2f}", f"{median(phase, 'GBps'):.2f}",
                      f"{median(phase, 'GBps') / ratio:.2f}" if ratio == ratio and ratio else "-",
                      f"{ratio:.2f}" if ratio == ratio else "-"))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print()
    for index, row_cells in enumerate(table):
        print("  ".join(cell.rjust(widths[i]) if i else cell.ljust(widths[i]) for i, cell in enumerate(row_cells)))
        if index == 0:
            print("  ".join("-" * w for w in widths))
    step_s = statistics.median(row["s"] for row in rows)
    print(f"\nmedian step {step_s:.1f} s; peak RSS {peak:.2f} GiB (goal < 12); after the build {init_peak:.2f} GiB; "
          f"plain sequential (mean of before and after) write {plain['write_GBps']:.2f} / read "
          f"{plain['read_GBps']:.2f} GB/s")

    result = {
        "benchmark": "tiers", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "args": vars(args) | {
            "json": str(args.json)}, "directory": str(root), "free_GB_before": free_gb,
        "parameters": params, "state_GB_at_16B": 16 * params / GB, "plain": plain, "plain_before": before, "plain_after": after, "init_s": init_s,
        "peak_rss_GiB": peak, "peak_rss_after_build_GiB": init_peak, "median_step_s": step_s, "steps": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
