#!/usr/bin/env python
"""By-hand benchmark: the step time and peak memory of each optimizer zero3 steps.

Not a test. It trains the built-in GPT (default 6 x 512, bf16) at 2 ranks on gloo, one
thread per rank, with each optimizer as the config's `optimizer` section, using
benchmarks/step_time.py's launcher and timing (each run in fresh processes; a step's time is
its slowest rank's; an optimizer's figure is the median over `--rounds` alternated runs of each
run's median step). DeepSpeed runs the same config beside zero3 for the optimizers it has
(Adam, AdamW, Lion, Muon) when `import deepspeed` works. Prints a table (step time, its ratio
to AdamW, peak RSS and its ratio to AdamW, DeepSpeed's step time and zero3's ratio to it) and
writes JSON.

For Muon it also measures how the Newton-Schulz work splits: torch's iteration timed on every
matrix of the model in one process (all of it, as a single process does it), then the matrices
each rank owns under zero3's owner assignment (zero3.optim.muon.MatrixExchange): the goal is
that the largest rank's share is about 1/nproc of the whole.

    python benchmarks/optimizers.py                     # every optimizer, 1 round
    python benchmarks/optimizers.py --optimizers AdamW,SGD,Lion --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_time  # noqa: E402  (the launcher, the worker and the statistics)

from zero3.data import CharTokenizer, load_corpus  # noqa: E402
from zero3.models.gpt import GPTConfig  # noqa: E402

# The config sections compared (lr of the order each is used at; none of it changes the time).
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "AdamW": step_time.ADAMW,
    "Adam": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}},
    "SGD": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}},
    "Adagrad": {"type": "Adagrad", "params": {"lr": 1e-2}},
    "RMSprop": {"type": "RMSprop", "params": {"lr": 1e-3}},
    "NAdam": {"type": "NAdam", "params": {"lr": 1e-3}},
    "RAdam": {"type": "RAdam", "params": {"lr": 1e-3}},
    "Adamax": {"type": "Adamax", "params": {"lr": 1e-3}},
    "Lion": {"type": "Lion", "params": {"lr": 1e-4, "weight_decay": 0.0}},
    "Muon": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3, "weight_decay": 0.0}},
}
DEEPSPEED_HAS = ("AdamW", "Adam", "Lion", "Muon")
_DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "optimizers.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"from {', '.join(OPTIMIZERS)}")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--out", type=Path, default=_DEFAULT_OUT)
    return p


def newton_schulz_split(gpt: GPTConfig, nproc: int, repeats: int = 5) -> dict[str, Any]:
    """Newton-Schulz time per step: all matrices in one process, and each rank's owned ones."""
    import time

    from torch import nn
    from torch.optim._muon import _zeropower_via_newtonschulz

    from zero3.config import MuonParams, ZeroConfig
    from zero3.models.gpt import GPT
    from zero3.optim.muon import Matrix, MatrixExchange, uses_muon

    torch.set_num_threads(1)  # as each rank runs
    with torch.device("meta"):
        model = GPT(gpt)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    shapes = [p.shape for name, p in model.named_parameters() if uses_muon([name], p, p.shape, embeddings)]
    settings = MuonParams()

    def seconds(shape: torch.Size) -> float:
        matrix = torch.randn(shape)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            _zeropower_via_newtonschulz(matrix, settings.ns_coefficients, settings.ns_steps, settings.eps)
            best = min(best, time.perf_counter() - start)
        return best

    cost = [seconds(shape) for shape in shapes]
    matrices = [Matrix(i, shape, shape.numel(), -(-shape.numel() // nproc), 0) for i, shape in enumerate(shapes)]
    # Assigns the owners as every rank does (buckets of the default reduce_bucket_size).
    MatrixExchange(matrices, 0, nproc, None, ZeroConfig().reduce_bucket_size, settings)
    per_rank = [sum(c for m, c in zip(matrices, cost) if m.owner == r) * 1e3 for r in range(nproc)]
    return {"matrices": len(shapes), "single_ms": sum(cost) * 1e3, "per_rank_ms": per_rank}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    args = build_parser().parse_args(argv)
    console = Console(width=200)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown:
        print(f"unknown optimizer(s) {unknown}; choose from {', '.join(OPTIMIZERS)}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import deepspeed  # noqa: F401

        with_deepspeed = True
    except Exception:  # ImportError, or a broken install
        with_deepspeed = False
        console.print("deepspeed is not importable: zero3 only")
    corpus = load_corpus()
    gpt = GPTConfig(vocab_size=CharTokenizer(corpus).vocab_size, block_size=args.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    tokens_per_step = args.micro_batch * args.nproc * args.block_size
    jobs = [(name, "zero3") for name in names]
    if with_deepspeed:
        jobs += [(name, "deepspeed") for name in names if name in DEEPSPEED_HAS]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {job: [] for job in jobs}
    failed: dict[tuple[str, str], str] = {}
    for round_index in range(args.rounds):
        shift = round_index % len(jobs)
        for name, engine in jobs[shift:] + jobs[:shift]:
            job = step_time.Job(
                engine=engine, model=gpt, micro_batch=args.micro_batch, steps=args.steps, warmup=args.warmup,
                seed=0, precision=args.precision, optimizer=json.dumps(OPTIMIZERS[name]),
            )
            console.print(f"round {round_index + 1}/{args.rounds}: {engine} with {name} ...")
            if (name, engine) in failed:
                continue
            try:
                runs[(name, engine)].append(step_time.summarize(step_time.launch(job, args.nproc), tokens_per_step))
            except Exception as exc:  # a DeepSpeed optimizer that does not run on this machine, say
                text = exc.format_msg() if hasattr(exc, "format_msg") else str(exc)
                causes = [line.strip() for line in text.splitlines() if "Error" in line and ":" in line]
                failed[(name, engine)] = (causes[-1] if causes else type(exc).__name__)[:200]
                console.print(f"[red]{engine} with {name} failed[/red]: {failed[(name, engine)]}")
    combined = {f"{engine}:{name}": step_time.combine(found) for (name, engine), found in runs.items() if found}
    table = Table(title=f"optimizers: GPT {args.n_layer} x {args.n_embd} ({gpt.num_parameters() / 1e6:.1f}M), "
                        f"{args.precision}, {args.nproc} ranks, median step over {args.rounds} round(s)")
    for column in ("optimizer", "zero3 ms", "vs AdamW", "peak RSS MiB", "vs AdamW", "DeepSpeed ms", "zero3 / DS",
                   "first -> last loss"):
        table.add_column(column, justify="right")
    adamw = combined.get("zero3:AdamW")
    for name in names:
        if f"zero3:{name}" not in combined:
            table.add_row(name, "failed", *["-"] * 6)
            continue
        ours = combined[f"zero3:{name}"]
        theirs = combined.get(f"deepspeed:{name}")
        table.add_row(
            name, f"{ours['median_ms']:.1f}",
            f"{ours['median_ms'] / adamw['median_ms']:.2f}" if adamw else "-",
            f"{ours['peak_memory_bytes'] / 2**20:.0f}",
            f"{ours['peak_memory_bytes'] / adamw['peak_memory_bytes']:.2f}" if adamw else "-",
            f"{theirs['median_ms']:.1f}" if theirs else "-",
            f"{ours['median_ms'] / theirs['median_ms']:.2f}" if theirs else "-",
            f"{ours['first_loss']:.3f} -> {ours['last_loss']:.3f}",
        )
    console.print(table)
    split = newton_schulz_split(gpt, args.nproc) if "Muon" in names else None
    if split is not None:
        shares = ", ".join(f"rank {r}: {ms:.1f} ms" for r, ms in enumerate(split["per_rank_ms"]))
        console.print(
            f"Muon Newton-Schulz per step: one process {split['single_ms']:.1f} ms; at {args.nproc} ranks {shares} "
            f"(largest share / whole = {max(split['per_rank_ms']) / split['single_ms']:.2f})"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {k: v for k, v in vars(args).items() if k != "out"} | {"torch": torch.__version__,
                                                                   "num_parameters": gpt.num_parameters()}
    args.out.write_text(json.dumps(
        {"setup": setup, "optimizers": OPTIMIZERS, "results": combined, "newton_schulz": split,
         "failed": {f"{engine}:{name}": why for (name, engine), why in failed.items()}}, indent=2) + "\n")
    console.print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
