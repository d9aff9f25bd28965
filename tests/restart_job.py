"""A training job that tests kill and restart: `torchrun ... tests/restart_job.py OUT --precision fp32 ...`.

It trains a small token model with dropout (so the random generators matter)
on a stateful sampler registered with the engine (so the data order matters),
with automatic checkpoints and `resume`, as a long job would. `--kill
ATTEMPT:RANK:STEP:POINT` (repeatable) makes RANK SIGKILL itself during
torchrun attempt ATTEMPT (TORCHELASTIC_RESTART_COUNT) at optimizer step STEP:
`mid_step` (after the step's backward, before `engine.step()`), `mid_save`
(inside the save that step makes, after its files are written, before the tag
is published), `after_step` (right after `engine.step()` returned, before
the step's loss is written: an async save may still be writing, a blocking
one is published). Each rank writes what it saw under OUT: each step's loss
(`loss_<step>_r<rank>.txt`, rewritten by a later attempt; a rank killed
between a step and its loss file leaves none, and a later attempt that
resumes from that step's checkpoint does not run it again), what each
attempt resumed from and the newest tag published when it started
(`attempt<N>_r<rank>.json`), and at the end the whole
fp32 parameters (`final.pt`, rank 0) and a draw from each rank's generator
(`final_r<rank>.json`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, SEQ = 48, 32, 8
SAMPLES = 96


class DropoutLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.drop = nn.Dropout(0.2)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = hidden + self.down(self.drop(F.gelu(self.up(hidden))))
        logits = self.head(hidden).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class GlobalSampler:
    """Global batches from a shuffled epoch (the shuffle seeded by the epoch); each rank reads its rows
    of each micro-batch. Its state (epoch, position) counts samples of the whole job, so it means the
    same at any world size."""

    def __init__(self, global_batch: int) -> None:
        data = torch.Generator().manual_seed(7)
        self.tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=data)
        self.global_batch = global_batch
        self.epoch = 0
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def seek(self, samples: int) -> None:
        self.epoch, self.position = divmod(samples, SAMPLES)

    def next_global_batch(self) -> torch.Tensor:
        if self.position + self.global_batch > SAMPLES:
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + self.epoch))
        rows = self.tokens[order[self.position : self.position + self.global_batch]]
        self.position += self.global_batch
        return rows


class Warnings(logging.Handler):
    """The engine's warnings while it is built (and resumed)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def config(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4,
                                                     "warmup_type": "linear"}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "mics_shard_size": args.mics, "zero_hpz_partition_size": args.hpz},
        "checkpoint": {"dir": args.ckpt, "interval_steps": args.interval, "async_save": args.async_save,
                       "keep_last": 2, "resume": True},
        "steps_per_print": None,
    }
    if args.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--interval", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--kill", action="append", default=[], metavar="ATTEMPT:RANK:STEP:POINT")
    parser.add_argument("--mics", type=int, default=-1, help="zero_optimization.mics_shard_size")
    parser.add_argument("--hpz", type=int, default=1, help="zero_optimization.zero_hpz_partition_size")
    return parser.parse_args(argv)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def train(argv: list[str]) -> None:
    import zero3
    from zero3.checkpoint import tag_write

    args = parse(argv)
    out = Path(args.out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    zero3.init_distributed()
    rank = dist.get_rank()
    kills = [tuple(item.split(":")) for item in args.kill]
    my_kills = {(int(step), point) for a, r, step, point in kills if int(a) == attempt and int(r) == rank}

    # The newest save that completed (it names its tag in `latest` last) before this attempt started: the
    # last attempt's ranks and their writers are gone, and this attempt has saved nothing yet.
    latest = Path(args.ckpt, "latest")
    published = int(latest.read_text().strip().removeprefix("global_step")) if latest.is_file() else 0
    torch.manual_seed(1)  # the same initial weights on every rank and attempt (a resume overwrites them)
    cfg = config(args)
    warnings = Warnings()
    logging.getLogger("zero3").addHandler(warnings)
    if args.mics == -1:
        with zero3.Init(config=cfg):
            model = DropoutLM()
    else:  # zero3.Init partitions over every rank: MiCS partitions at initialize
        model = DropoutLM()
    engine, *_ = zero3.initialize(model=model, config=cfg)
    nodes = engine.comm.topology.nodes
    logging.getLogger("zero3").removeHandler(warnings)
    world = engine.world_size
    sampler = GlobalSampler(args.global_batch)
    engine.register_checkpoint_state("sampler", sampler)
    resumed_at = engine.global_steps
    restored = sampler.position + sampler.epoch * SAMPLES == resumed_at * args.global_batch
    if not restored:  # saved at another world size: the engine leaves per-rank states alone
        sampler.seek(resumed_at * args.global_batch)
    (out / f"attempt{attempt}_r{rank}.json").write_text(json.dumps({
        "resumed_at": resumed_at, "published": published, "client_state": engine.client_state,
        "sampler_restored": restored,
        "world": world, "gas": engine.gradient_accumulation_steps(), "warnings": warnings.messages,
        "nodes": [nodes.num_nodes, nodes.ranks_per_node, nodes.node_rank],
        "shard": [engine.mesh.shard_size, engine.mesh.replicate_size],
    }))

    real_checksums = tag_write.checksums

    def checksums_or_die(files: list[Path], checksum: Any) -> Any:
        # Called by the save (in the background, for an async one) once its files are written; the tag
        # being written says which step's save this is.
        saving = files[0].parent.name if files else ""
        if any(saving == f".global_step{step}.incomplete" for step, point in my_kills if point == "mid_save"):
            die()
        return real_checksums(files, checksum)

    tag_write.checksums = checksums_or_die  # type: ignore[assignment]
    # An async save is written by the rank's checkpoint writer process, where tests/hooks/sitecustomize.py
    # kills the rank at the same point.
    mid_save = [str(step) for step, point in my_kills if point == "mid_save"]
    if mid_save:
        os.environ["ZERO3_TEST_MID_SAVE_KILLS"] = ",".join(mid_save)

    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        rows = sampler.next_global_batch()
        losses = []
        for index in range(gas):
            start = (index * world + rank) * micro
            piece = rows[start : start + micro]
            loss = engine(piece[:, :-1], piece[:, 1:])
            engine.backward(loss)
            losses.append(loss.detach().float().item())
            if index == gas - 1 and (step, "mid_step") in my_kills:
                die()
            engine.client_state = {"step": step}
            engine.step()
        if (step, "after_step") in my_kills:
            die()
        (out / f"loss_{step}_r{rank}.txt").write_text(" ".join(repr(value) for value in losses))

    full = {name: zero3.safe_get_full_fp32_param(param).clone() for name, param in engine.module.named_parameters()}
    if rank == 0:
        torch.save(full, out / "final.pt")
    (out / f"final_r{rank}.json").write_text(json.dumps({"draw": torch.rand(3).tolist(), "steps": engine.global_steps}))
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    train(sys.argv[1:])
