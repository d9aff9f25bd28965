"""A training script that picks up where it stopped, in the shape of a DeepSpeed script.

    torchrun --standalone --nproc_per_node 2 examples/train.py --ckpt ckpt --steps 40
    torchrun --standalone --nproc_per_node 2 --max-restarts 3 examples/train.py --ckpt ckpt   # restarted on failure

The built-in GPT, built under `zero3.Init` on the built-in corpus, trained with the config's automatic
checkpoints (`checkpoint.interval_steps`, asynchronous, the last two kept) and `resume: true`: started
again (by hand, or by torchrun after a rank died) it loads the newest complete checkpoint inside
`zero3.initialize` and goes on from `engine.global_steps`. Each step's global batch is drawn from a
generator seeded with the step's number and each rank takes its rows of it, so the batches after a
resume are the ones the run would have seen, at any world size.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

import zero3
from zero3.data import CharTokenizer, load_corpus, sample_global_batch
from zero3.models.gpt import GPT, GPTConfig


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default="ckpt", help="checkpoint directory (made if missing)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of the whole run")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every N optimizer steps")
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
        "checkpoint": {"dir": args.ckpt, "interval_steps": args.save_every, "async_save": True,
                       "keep_last": 2, "resume": True},
    }
    if args.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def main() -> None:
    args = parse()
    zero3.init_distributed()  # torchrun's variables; a world of one under plain python
    rank, world = dist.get_rank(), dist.get_world_size()
    text = load_corpus()
    tokenizer = CharTokenizer(text)
    tokens = tokenizer.encode(text)
    cfg = config(args)
    torch.manual_seed(0)  # the same initial weights on every rank (a resume overwrites them)
    with zero3.Init(config=cfg):
        model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.block_size,
                              n_layer=args.n_layer, n_head=4, n_embd=args.n_embd))
    engine, *_ = zero3.initialize(model=model, config=cfg)
    if engine.global_steps and rank == 0:
        print(f"resumed at step {engine.global_steps}", flush=True)
    for step in range(engine.global_steps, args.steps):
        x, y = sample_global_batch(tokens, args.block_size, args.micro_batch * world,
                                   torch.Generator().manual_seed(step))
        rows = slice(rank * args.micro_batch, (rank + 1) * args.micro_batch)
        loss = engine(x[rows].to(engine.device), y[rows].to(engine.device))["loss"]
        engine.backward(loss)
        engine.step()  # saves every --save-every steps, in the background
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
    engine.wait_for_checkpoint()
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
