"""A DeepSpeed ZeRO-3 job and its zero3 continuation, for the checkpoint import's tests.

`python -m torch.distributed.run ... tests/deepspeed_job.py OUT --ckpt DIR --engine deepspeed` trains the
model below with DeepSpeed (0.19.8, on the CPU: DS_ACCELERATOR=cpu) for `--save-at` steps, saves a
DeepSpeed checkpoint into DIR, trains on to `--steps` and writes each step's loss (averaged over the
global batch) to OUT/losses_deepspeed.json. `--engine zero3 --ckpt ZERO3_DIR` builds the same model on
zero3 with the same config, loads the imported checkpoint and trains the same steps, writing
OUT/losses_zero3_w<world>.json. Both read each step's global batch from a generator seeded by the step,
so any world size sees the same data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQ, GLOBAL_BATCH = 40, 24, 6, 8


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))  # a persistent buffer to carry over

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) * self.scale.to(self.embed.weight.dtype)
        hidden = hidden + self.down(F.gelu(self.up(hidden)))
        logits = self.head(self.norm(hidden)).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def config(precision: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))


def train_steps(engine: Any, first: int, last: int, rank: int, world: int) -> dict[int, float]:
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    device = next(engine.module.parameters()).device
    losses = {}
    for step in range(first, last + 1):
        rows = global_batch(step)
        total = torch.zeros(1)
        for index in range(gas):
            start = (index * world + rank) * micro
            piece = rows[start : start + micro].to(device)
            loss = engine(piece[:, :-1], piece[:, 1:])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().cpu()
        dist.all_reduce(total)
        losses[step] = total.item() / (gas * world)
    return losses


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--engine", choices=("deepspeed", "zero3"), required=True)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    cfg = config(args.precision)
    torch.manual_seed(0)
    if args.engine == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = TinyLM()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        before = train_steps(engine, 1, args.save_at, rank, world)
        engine.save_checkpoint(args.ckpt, client_state={"data_position": args.save_at * GLOBAL_BATCH})
        after = train_steps(engine, args.save_at + 1, args.steps, rank, world)
        name = "losses_deepspeed.json"
    else:
        import zero3

        zero3.init_distributed()
        rank, world = dist.get_rank(), dist.get_world_size()
        with zero3.Init(config=cfg):
            model = TinyLM()
        engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        path, client = engine.load_checkpoint(args.ckpt)
        assert path is not None and client == {"data_position": args.save_at * GLOBAL_BATCH}, (path, client)
        assert engine.global_steps == args.save_at, engine.global_steps
        before = {}
        after = train_steps(engine, args.save_at + 1, args.steps, rank, world)
        name = f"losses_zero3_w{world}.json"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps({"before": before, "after": after, "lr": engine.get_lr()}))
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main(sys.argv[1:])
