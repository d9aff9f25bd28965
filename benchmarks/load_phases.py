#!/usr/bin/env python
"""By-hand benchmark: where zero3's checkpoint load spends its time, beside plain ``torch.load``.

Not a test: nothing here asserts on timings. The setup is
``benchmarks/checkpoint.py``'s (two gloo ranks, an fp32 GPT whose master and
Adam moments come to about ``--state-mib`` MiB, one AdamW step). zero3 saves
one tag and each rank ``torch.save``s the same bytes to a file of its own;
then, ``--repeats`` times, alternating which goes first, each is loaded with
the page cache dropped: ``engine.load_checkpoint(dir, tag)`` at the saved
layout and ``torch.load(file, weights_only=True)``.

zero3's load is timed at the end of each of its stages, in each rank, from
the call (the functions of ``zero3.checkpoint.state`` that make them are
wrapped here; nothing else changes):

* ``checked``   -- the engine file and DCP's metadata read and matched against the engine;
* ``paged in``  -- the thread that brings the rank's own data files into the page cache is done
                   (zero3.checkpoint.read_ahead's [Note: reading ahead]), from the load's start;
* ``read``      -- every item this rank loads read and checked against its sum;
* ``agreed``    -- every rank has said what its reads found (the one exchange);
* ``copied``    -- the items copied into the engine's buffers;
* ``returned``  -- ``load_checkpoint`` returned (optimizer scalars, counters, generators).

The table gives each mark's median over repeats (the slowest rank's for the
whole load, each rank's own for the marks), and plain ``torch.load``'s time.

    python benchmarks/load_phases.py                        # 512 MiB of state, 9 repeats: ~3 min here
    python benchmarks/load_phases.py --state-mib 64 --repeats 2 --dir /tmp/lp   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from checkpoint import MIB, drop_cache, launch, model_config, stepped_engine  # benchmarks/checkpoint.py, beside this script
from zero3.models.gpt import GPTConfig

_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "load_phases.json"
MARKS = ("checked", "paged in", "read", "agreed", "copied", "returned")


class Marks:
    """Seconds from the start of the load in progress at which each stage ended, on this rank."""

    def __init__(self) -> None:
        self.started = 0.0
        self.now: dict[str, float] = {}

    def start(self) -> None:
        self.started, self.now = time.perf_counter(), {}

    def mark(self, name: str) -> None:
        self.now[name] = time.perf_counter() - self.started

    def at_end(self, owner: Any, attribute: str, name: str) -> None:
        """Mark `name` whenever `owner.attribute` (a function) returns."""
        function: Callable[..., Any] = getattr(owner, attribute)

        def marked(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            finally:
                self.mark(name)

        setattr(owner, attribute, marked)


def worker(args: dict[str, Any]) -> dict[str, Any]:
    import zero3.checkpoint.read_ahead as read_ahead
    import zero3.checkpoint.state as checkpoint_state
    from zero3.checkpoint.same_layout import SameLayoutLoad

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = Path(args["dir"])
    cfg = GPTConfig(**args["model"])
    engine, flat = stepped_engine(cfg, rank)  # checkpoint.py's engine and same bytes

    marks = Marks()
    marks.at_end(checkpoint_state, "_check", "checked")
    marks.at_end(read_ahead.PageIn, "_run", "paged in")
    marks.at_end(SameLayoutLoad, "read", "read")
    marks.at_end(engine.protocol, "outcomes", "agreed")
    marks.at_end(SameLayoutLoad, "commit", "copied")

    zero3_dir, plain = root / "zero3", root / f"plain-rank{rank}.pt"
    engine.save_checkpoint(zero3_dir, tag="t")
    with open(plain, "wb") as out:
        torch.save(flat, out)
        out.flush()
        os.fsync(out.fileno())
    loads: list[dict[str, float]] = []
    plain_s: list[float] = []
    for repeat in range(args["repeats"]):
        for which in (("zero3", "plain") if repeat % 2 == 0 else ("plain", "zero3")):
            if which == "zero3":
                if rank == 0:
                    drop_cache([zero3_dir / "t"])
                dist.barrier()
                marks.start()
                engine.load_checkpoint(zero3_dir, tag="t")
                marks.mark("returned")
                loads.append(dict(marks.now))
            else:
                drop_cache([plain])
                dist.barrier()
                started = time.perf_counter()
                torch.load(plain, weights_only=True)
                plain_s.append(time.perf_counter() - started)
    engine.destroy()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(zero3_dir, ignore_errors=True)
    plain.unlink()
    dist.destroy_process_group()
    return {"loads": loads, "plain_s": plain_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=float, default=512.0)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", default=None, help="where the checkpoint and plain files go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=_DEFAULT_OUT)
    args = parser.parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="zero3-load-phases-"))
    root.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args.state_mib)
    params = cfg.num_parameters()
    print(f"GPT {cfg.n_layer} x {cfg.n_embd}: {params / 1e6:.1f}M params, {12 * params / MIB:.0f} MiB of "
          f"checkpointed state, 2 ranks, gloo; in {root}", flush=True)
    job = {"dir": str(root), "repeats": args.repeats, "model": {
        "vocab_size": cfg.vocab_size, "block_size": cfg.block_size, "n_layer": cfg.n_layer,
        "n_head": cfg.n_head, "n_embd": cfg.n_embd}}
    results = launch(job, worker, "load-phases")
    ranks = sorted(results)
    whole = [max(results[r]["loads"][i]["returned"] for r in ranks) for i in range(args.repeats)]
    plain = [max(results[r]["plain_s"][i] for r in ranks) for i in range(args.repeats)]
    marks = {rank: {name: statistics.median(load[name] for load in results[rank]["loads"] if name in load)
                    for name in MARKS if any(name in load for load in results[rank]["loads"])} for rank in ranks}
    print(f"\n{'mark (s from the call)':<28}" + "".join(f"{f'rank {r}':>10}" for r in ranks))
    for name in MARKS:
        print(f"{name:<28}" + "".join(f"{marks[r].get(name, float('nan')):>10.3f}" for r in ranks))
    ratio = statistics.median(plain) / statistics.median(whole)
    print(f"\nzero3 load, slowest rank: median {statistics.median(whole):.3f} s ({', '.join(f'{s:.3f}' for s in whole)})")
    print(f"plain torch.load, slowest rank: median {statistics.median(plain):.3f} s ({', '.join(f'{s:.3f}' for s in plain)})")
    print(f"plain / zero3, of the medians: {ratio:.2f}")
    from provenance import write_run  # benchmarks/provenance.py, beside this script

    write_run(args.json, "load_phases", args, host=platform.node(), parameters=params, marks_median_s=marks,
              zero3_load_s=whole, plain_load_s=plain, plain_over_zero3=ratio)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
