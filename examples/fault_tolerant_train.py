"""One replica group of a fault-tolerant job: groups train together through torchft, and a group that dies
comes back with its peers' state while they train on (docs/fault_tolerance.md).

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 &
    export TORCHFT_LIGHTHOUSE=http://localhost:29510
    TORCHFT_REPLICA_ID=0 torchrun --standalone --nproc_per_node 2 --max-restarts 3 examples/fault_tolerant_train.py &
    TORCHFT_REPLICA_ID=1 torchrun --standalone --nproc_per_node 2 --max-restarts 3 examples/fault_tolerant_train.py &

Kill one group's ranks (`pkill -9 -f "fault_tolerant_train.py"` picks both groups; kill one torchrun's
workers by pid): the other group drops at most the step it was in and trains on alone; the killed group's
torchrun restarts it, and it joins the next quorum with the other group's state. Each group reads data of
its own: its batches are drawn from a generator seeded with the step and the group's name.
"""

from __future__ import annotations

import argparse
import os
import zlib
from typing import Any

import torch
import torch.distributed as dist

import zero3
from zero3.data import CharTokenizer, load_corpus, sample_global_batch
from zero3.models.gpt import GPT, GPTConfig


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of the whole run")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    return parser.parse_args()


def config(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 10}},
        "zero_optimization": {"stage": 3},
        # The group's name and the lighthouse come from TORCHFT_REPLICA_ID and TORCHFT_LIGHTHOUSE.
        "fault_tolerance": {"enabled": True, "min_replicas": 1},
        "steps_per_print": None,
    }
    if args.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def main() -> None:
    args = parse()
    zero3.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = os.environ.get("TORCHFT_REPLICA_ID", "0")
    text = load_corpus()
    tokenizer = CharTokenizer(text)
    tokens = tokenizer.encode(text)
    cfg = config(args)
    torch.manual_seed(0)
    with zero3.Init(config=cfg):
        model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.block_size,
                              n_layer=args.n_layer, n_head=4, n_embd=args.n_embd))
    engine, *_ = zero3.initialize(model=model, config=cfg)
    replicas = engine.fault_tolerance.replicas
    while engine.global_steps < args.steps:
        step = engine.global_steps  # where the groups are: a group that just joined took it from a peer
        seed = zlib.crc32(f"{group}/{step}".encode())
        x, y = sample_global_batch(tokens, args.block_size, args.micro_batch * world, torch.Generator().manual_seed(seed))
        rows = slice(rank * args.micro_batch, (rank + 1) * args.micro_batch)
        loss = engine(x[rows].to(engine.device), y[rows].to(engine.device))["loss"]
        engine.backward(loss)
        engine.step()
        if rank == 0 and engine.global_steps % 10 == 0 and not engine.optimizer.dropped:
            print(f"group {group} step {engine.global_steps}: loss {loss.item():.4f}, "
                  f"{replicas.participants()} group(s) in the step", flush=True)
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
