#!/usr/bin/env python
"""By-hand benchmark: the loss of ZeRO++'s quantized collectives beside plain ZeRO-3's (issue 41's plot).

Not a test: nothing here asserts. Four ranks (gloo, one process each) run as 2 simulated nodes of 2 and
train the built-in GPT (bf16) on the built-in character corpus, the same global batches in every variant:
plain ZeRO-3, qwZ (int8 weight gathers), qgZ (int4 all-to-all gradient reduction), and all three ZeRO++
parts (hpZ + qwZ + qgZ). Prints the loss every `--every` steps and the last window's mean against plain's,
and writes JSON with every step's loss (`python benchmarks/figures.py --plots` draws the curves).

    python benchmarks/zeropp_loss.py --json benchmarks/measured/zeropp_loss_cpu.json   # ~5 min here
    python benchmarks/zeropp_loss.py --steps 4 --n-layer 1    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_REPO = Path(__file__).resolve().parent.parent
RANKS_PER_NODE, NODES = 2, 2
VARIANTS: dict[str, dict[str, Any]] = {
    "plain ZeRO-3": {},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "hpZ + qwZ + qgZ": {"zero_hpz_partition_size": RANKS_PER_NODE, "zero_quantized_weights": True,
                        "zero_quantized_gradients": True},
}


def _worker(args: argparse.Namespace, out_dir: str) -> None:
    import zero3
    from zero3.data import CharTokenizer, load_corpus, sample_global_batch
    from zero3.models.gpt import GPT, GPTConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(LOCAL_WORLD_SIZE=str(RANKS_PER_NODE), GROUP_RANK=str(rank // RANKS_PER_NODE))
    torch.set_num_threads(1)
    zero3.init_distributed()
    tokenizer = CharTokenizer.from_corpus()
    tokens = tokenizer.encode(load_corpus())
    curves: dict[str, list[float]] = {}
    for name, zero in VARIANTS.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                              n_head=4, n_embd=args.n_embd))
        engine, *_ = zero3.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "bf16": {"enabled": True},
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
        })
        generator = torch.Generator().manual_seed(1)  # the same global batches in every variant
        losses = []
        for _ in range(args.steps):
            x, y = sample_global_batch(tokens, args.block_size, args.micro_batch * world, generator)
            loss = engine(x[rank::world], y[rank::world])["loss"]
            engine.backward(loss)
            engine.step()
            mean = loss.detach().float().reshape(1).clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        curves[name] = losses
        engine.destroy()
        if rank == 0:
            print(f"  {name}: first {losses[0]:.3f}, last {losses[-1]:.3f}", flush=True)
    if rank == 0:
        torch.save(curves, Path(out_dir) / "curves.pt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=25, help="print the loss every this many steps")
    parser.add_argument("--window", type=int, default=20, help="steps of the final mean")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--json", type=Path, default=_REPO / "benchmarks" / "results" / "zeropp_loss.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import write_run  # benchmarks/provenance.py, beside this script
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory() as out_dir:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=RANKS_PER_NODE * NODES, rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", run_id=f"zeropp-loss-{uuid.uuid4().hex[:8]}",
                              monitor_interval=0.2)
        elastic_launch(config, _worker)(args, out_dir)
        curves: dict[str, list[float]] = torch.load(Path(out_dir) / "curves.pt")
    window = min(args.window, args.steps)
    final = {name: statistics.fmean(curve[-window:]) for name, curve in curves.items()}
    plain = final["plain ZeRO-3"]
    print(f"\nloss, GPT {args.n_layer} x {args.n_embd} on the built-in corpus, 4 ranks as 2 nodes of 2, bf16")
    marks = sorted(set(range(0, args.steps, args.every)) | {args.steps - 1})
    print(f"{'variant':18} " + " ".join(f"{'step ' + str(m + 1):>9}" for m in marks)
          + f" {'last ' + str(window):>9} {'vs plain':>9}")
    for name, curve in curves.items():
        print(f"{name:18} " + " ".join(f"{curve[m]:9.3f}" for m in marks)
              + f" {final[name]:9.3f} {final[name] / plain:9.3f}")
    write_run(args.json, "zeropp_loss", args, curves=curves, final_mean=final,
              final_vs_plain={n: v / plain for n, v in final.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
