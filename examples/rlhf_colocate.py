"""Colocated RLHF: an actor and a critic (zero3 engines) and a frozen reference on the same ranks,
each engine parking its states while another one works.

This is a *workflow* demo, not a tuned RL algorithm. Each iteration:

1. **generate**: the actor's weights are delivered whole, in buckets of `--sync-bucket-mib`
   (one all-gather each, the next in flight), by `zero3.weights.load_into` into a plain
   (non-zero3) copy of its architecture, the generator, which samples `--new-tokens` characters after each prompt (a random window of
   the built-in corpus) with plain temperature sampling. The actor is parked meanwhile: the
   stream reads its 16-bit shards where they rest (host memory or disk).
2. **score**: a rule-based reward (the fraction of sampled characters that are lowercase
   vowels: a stand-in for a reward model) minus a KL penalty against the frozen reference
   (`--kl-coef` times the summed log-ratio of the sampled tokens, as in InstructGPT); the
   critic's value of the prompt is the baseline.
3. **train-actor**: a PPO-style clipped surrogate with one advantage per sequence (return
   minus value; no GAE, no advantage whitening), `--epochs` steps on the batch, while the
   critic's and the reference's states are parked.
4. **train-critic**: the critic regresses the return (squared error), while the actor's
   states are parked.

"Parked" is `engine.offload_states()` (all five states) to host memory (`--park cpu`) or to
files on disk (`--park nvme`, under `--nvme-path`, default a temporary directory); a parked
engine is brought back with `engine.reload_states()` just before its next use, and parked
again right after it. So while one engine trains, the others hold no memory of their states, and
the critic is reloaded twice an iteration (to score, then to train after the actor has).

**The reference model** is a zero3 engine without an optimizer (not a plain module): it is
partitioned like the actor, so each rank holds 2P/N bytes of it instead of a whole copy
(a reference as large as the actor does not fit whole where the actor needs ZeRO-3), and it
can be parked like the others (its 16-bit shards are its only state). It starts as a copy of
the actor (built from the same seed) and never changes.

**The default park target.** With a GPU the states go to host memory (`cpu`). A CPU engine's
states already live in host memory, so `offload_states(device="cpu")` moves nothing there
(zero3 logs that it did nothing): without a GPU the default is therefore `nvme`, files under
`--nvme-path` (by default a temporary directory, removed at the end). Host memory falls as the
states leave for disk; the files' pages may stay in the kernel's page cache, which is
reclaimable and not part of the process's memory.

**Memory.** On CUDA: `torch.cuda.memory_allocated` (and its peak per phase). On the CPU: the
process's resident set size (RSS, from /proc/self/statm), sampled every `--sample-ms` by a thread
for the plot, beside the engines' own accounting (`state_report()` bytes per place). A park to
disk frees the engine's flat buffers and zero3 then calls glibc's `malloc_trim(0)` itself
(`zero3.accelerator.release_host_memory`): a buffer glibc mapped on its own (above its mmap
threshold, and every buffer a reload made) leaves RSS at once, a heap-allocated one through that
trim. The example trims the heap itself only to measure fairly: before each park, so the fall it
reports is the park's own and not heap garbage of earlier phases, and, in the pass without
parking, where a park would be, so both passes keep the same freed-but-held heap (see the Note in
`Pass.park`). The fall is read when `offload_states` returns and again shortly after ("settled"),
as a check that nothing is freed late (the Note says why it once was).

**Output.** A per-phase table (rank 0; seconds, memory, each engine's bytes in memory or parked;
means over the iterations, memory from the last one) with the same run without parking beside it
(`--compare`, on by default: a second pass in this process, same seeds, so the same losses); the
parking and reloading rates next to a plain copy of the same bytes timed in the same run (host
memory: a tensor copy device <-> pinned host; disk: one `write()` of the bytes, then one
`readinto()` of a preallocated buffer, as benchmarks/offload.py does), and each park's memory
fall over the bytes it parked; each engine's `state_report()` while the actor trains. `--out` gets
`rlhf_colocate.json` (every number, every rank, the memory samples) and `rlhf_colocate.png`
(memory over time, phases shaded; needs matplotlib: `pip install zero3[plot]`, else the PNG is
skipped with a message). Both passes share one process: a tiny warm-up pass first pays the
one-time costs (torch's lazy initialisation, thread arenas), and the pass without parking runs
before the one with, so what it leaves behind can only understate the saving.

    python examples/rlhf_colocate.py                                  # a world of one
    torchrun --nproc_per_node 2 examples/rlhf_colocate.py --iterations 3 --park nvme --out /tmp/rlhf

Run it after `pip install -e .` (so `zero3` imports). The device follows zero3's rule (README,
"Which device"); `--device cpu` forces the CPU (gloo).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn

import zero3
from zero3 import OffloadStateType, accelerator, comm
from zero3.cli import non_negative_float, positive_float, positive_int
from zero3.data import CharTokenizer, load_corpus, sample_global_batch
from zero3.models.gpt import GPT, Block, GPTConfig

ENGINES = ("actor", "critic", "reference")
JSON_NAME = "rlhf_colocate.json"
PNG_NAME = "rlhf_colocate.png"
REWARD_CHARS = "aeiou"
RATE_TARGET = 0.8  # park/reload GB/s over a plain copy of the same bytes (host memory)
MEMORY_TARGET = 0.95  # memory fall over the bytes a park moves off the device
# How long after a park the memory is read a second time ("settled"); see the Note in Pass.park.
SETTLE_S = 0.05


# ----------------------------------------------------------------------- options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Colocated RLHF with zero3: actor and critic engines park each other's states "
                    "(offload_states) while one trains; run plainly or under torchrun.",
    )
    model = parser.add_argument_group("models (the built-in GPT; the critic has a value head instead)")
    model.add_argument("--n-layer", type=positive_int, default=4, help="transformer blocks (default: %(default)s)")
    model.add_argument("--n-embd", type=positive_int, default=256, help="hidden size (default: %(default)s)")
    model.add_argument("--n-head", type=positive_int, default=4, help="attention heads (default: %(default)s)")
    rl = parser.add_argument_group("the RL loop")
    rl.add_argument("--iterations", type=positive_int, default=3,
                    help="generate / score / train-actor / train-critic rounds (default: %(default)s)")
    rl.add_argument("--batch", type=positive_int, default=8,
                    help="prompts per rank per iteration (default: %(default)s)")
    rl.add_argument("--prompt-len", type=positive_int, default=32, help="prompt characters (default: %(default)s)")
    rl.add_argument("--new-tokens", type=positive_int, default=32,
                    help="characters sampled after each prompt (default: %(default)s)")
    rl.add_argument("--temperature", type=positive_float, default=1.0,
                    help="sampling temperature (default: %(default)s)")
    rl.add_argument("--epochs", type=positive_int, default=1,
                    help="optimizer steps of each engine on an iteration's batch (default: %(default)s)")
    rl.add_argument("--lr", type=positive_float, default=1e-4,
                    help="AdamW learning rate, both engines (default: %(default)s)")
    rl.add_argument("--kl-coef", type=non_negative_float, default=0.05,
                    help="weight of the KL penalty against the reference (default: %(default)s)")
    rl.add_argument("--clip-ratio", type=positive_float, default=0.2, help="PPO clip range (default: %(default)s)")
    rl.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                    help="compute dtype of the engines (default: bf16 on CUDA, fp32 on the CPU, where a bf16 "
                         "backward is slow without bf16 matmul units)")
    rl.add_argument("--seed", type=int, default=0,
                    help="seeds the weights, prompts and sampling (default: %(default)s)")
    park = parser.add_argument_group("parking")
    park.add_argument("--park", choices=("cpu", "nvme", "none"), default=None,
                      help="where idle engines' states go: host memory, disk, or nowhere (default: cpu with a "
                           "GPU; nvme on the CPU, where the states already live in host memory)")
    park.add_argument("--nvme-path", type=Path, default=None,
                      help="directory for --park nvme (default: a temporary directory, removed at the end)")
    park.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                      help="also run the same iterations without parking and print them beside (default: on)")
    park.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                      help="run one iteration on a tiny model first, so one-time costs land in neither pass "
                           "(default: on)")
    park.add_argument("--rate-repeats", type=positive_int, default=3,
                      help="plain copies of each engine's bytes timed for the rate baseline (default: %(default)s)")
    park.add_argument("--sample-ms", type=positive_float, default=10.0,
                      help="memory sampling period for the plot, milliseconds (default: %(default)s)")
    rl.add_argument("--sync-bucket-mib", type=positive_float, default=64.0,
                    help="the weight sync's bucket, MiB (zero3.weights.load_into; default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("rlhf_colocate_out"),
                        help=f"output directory: {JSON_NAME} and {PNG_NAME} (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where every rank computes (default: zero3's rule: ZERO3_ACCELERATOR, else cuda if "
                             "there is a GPU per local rank, else cpu)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.nvme_path is not None and args.park not in (None, "nvme"):
        parser.error(f"--nvme-path is for --park nvme, not --park {args.park}")
    return args


def warmup_args(args: argparse.Namespace) -> argparse.Namespace:
    """The warm-up pass's options: one iteration of every phase on a tiny model."""
    return argparse.Namespace(**{**vars(args), "n_layer": 1, "n_embd": args.n_head * 8, "batch": 2,
                                 "prompt_len": 4, "new_tokens": 4, "iterations": 1, "epochs": 1})


def resolve_defaults(args: argparse.Namespace, device: torch.device) -> None:
    """The device-dependent defaults: the park target and the precision (see the module docstring)."""
    if args.park is None:
        args.park = "cpu" if device.type == "cuda" else "nvme"
    if args.precision is None:
        args.precision = "bf16" if device.type == "cuda" else "fp32"


# ------------------------------------------------------------------- the models


class Critic(nn.Module):
    """The actor's architecture (the built-in GPT's blocks) with a scalar value head instead of the
    LM head: one value per position."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.value_head = nn.Linear(cfg.n_embd, 1)
        self.apply(GPT._init_weights)
        nn.init.zeros_(self.value_head.weight)  # values start at 0 (under zero3.Init this write is kept)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.value_head(self.ln_f(x)).squeeze(-1)


def gpt_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, block_size=args.prompt_len + args.new_tokens,
                     n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)


def engine_config(args: argparse.Namespace, trained: bool) -> dict[str, Any]:
    """The DeepSpeed-style config; the reference has no optimizer (so no masters, gradients or moments)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        # 0: every parameter is partitioned, so every byte of the model is a parkable state.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if trained:
        cfg["gradient_clipping"] = 1.0
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}}
    if args.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def build_engines(args: argparse.Namespace, cfg: GPTConfig, device: torch.device) -> dict[str, zero3.ZeroEngine]:
    """Actor and reference from the same seed (the same weights), the critic from the next one."""
    engines: dict[str, zero3.ZeroEngine] = {}
    for name, make, seed, trained in (
        ("actor", GPT, args.seed, True), ("critic", Critic, args.seed + 1, True), ("reference", GPT, args.seed, False),
    ):
        config = engine_config(args, trained)
        torch.manual_seed(seed)
        with zero3.Init(config=config, device=device):
            model = make(cfg)
        engine, _, _, _ = zero3.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           device=device)
        if not trained:
            engine.eval()
        engines[name] = engine
    return engines


def build_generator(cfg: GPTConfig, device: torch.device) -> GPT:
    """A plain GPT with no weights of its own yet: built on the meta device (nothing allocated, no
    init run), then given uninitialised memory; `load_generator` fills it. fp32 whatever the engines'
    precision (it samples; the streamed 16-bit values are exact in fp32)."""
    with torch.device("meta"):
        generator = GPT(cfg)
    generator.to_empty(device=device)
    # to_empty gives each module a tensor of its own: tie the head to the embedding again (the stream
    # sends a tied weight once, under its first name).
    generator.lm_head.weight = generator.tok_emb.weight
    generator.eval().requires_grad_(False)
    return generator


def load_generator(generator: nn.Module, actor: zero3.ZeroEngine, bucket_bytes: int) -> int:
    """Deliver the actor's weights into the generator (collective: zero3.weights.load_into, which checks
    that every generator parameter gets one); returns the bytes delivered, in the actor's dtype."""
    zero3.weights.load_into(actor, generator, bucket_bytes=bucket_bytes)
    return sum(p.numel() for p in generator.parameters()) * actor.compute_dtype.itemsize


@torch.no_grad()
def sample(generator: GPT, prompts: torch.Tensor, new_tokens: int, temperature: float,
           rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature sampling, no KV cache (the sequences are short). Returns the sequences
    (prompt + sampled tokens) and the sampled tokens' log-probabilities under the generator."""
    seqs = prompts
    logps = []
    for _ in range(new_tokens):
        logits = generator(seqs)["logits"][:, -1, :].float() / temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        token = torch.multinomial(logprobs.exp(), 1, generator=rng)
        logps.append(logprobs.gather(1, token))
        seqs = torch.cat([seqs, token], dim=1)
    return seqs, torch.cat(logps, dim=1)


def response_logprobs(logits: torch.Tensor, seqs: torch.Tensor, prompt_len: int, temperature: float) -> torch.Tensor:
    """log p(token) of each sampled token, (batch, new_tokens), in fp32."""
    logits = logits[:, prompt_len - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(2, seqs[:, prompt_len:, None]).squeeze(2)


# ------------------------------------------------------------------ memory


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident set size (Linux), or None where /proc is missing."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def memory_now(device: torch.device) -> int:
    """The memory this example watches: device memory allocated on CUDA, the process's RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return rss_bytes() or 0


class MemorySampler:
    """A thread that records (seconds since start, memory) every `period` seconds, for the plot."""

    def __init__(self, device: torch.device, period: float) -> None:
        self.device, self.period = device, period
        self.start = time.perf_counter()
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlhf-memory-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.start, memory_now(self.device)))
            self._stop.wait(self.period)

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter() - self.start, memory_now(self.device)))
        return self.samples

    def peak_between(self, t0: float, t1: float) -> int:
        return max((m for t, m in list(self.samples) if t0 <= t <= t1), default=0)


def engine_bytes(engine: zero3.ZeroEngine, text: bool = False) -> dict[str, Any]:
    """The engine's own accounting: bytes in its device's memory, bytes parked (and where), and
    `get_state_devices` of every state ("meta": on disk); with `text`, the printed state_report() too."""
    report = engine.state_report()
    device = str(engine.device)
    resident = report.bytes_on(device)
    parked = {where: report.bytes_on(where) for where in {w for p in report.values() for w in p} if where != device}
    return {
        "resident": resident,
        "parked": sum(parked.values()),
        "parked_on": {where: n for where, n in parked.items() if n},
        "states": {state: dict(places) for state, places in report.items()},
        "devices": {s.value: sorted(str(d) for d in zero3.get_state_devices(engine, s)) for s in OffloadStateType},
        **({"report": str(report)} if text else {}),
    }


# ------------------------------------------------------------------ one pass


@dataclass
class PassRecorder:
    """Every phase of one pass on this rank: its label, kind, times, memory and the engines' bytes."""

    device: torch.device
    sampler: MemorySampler
    engines: dict[str, zero3.ZeroEngine]
    iteration: int = -1
    events: list[dict[str, Any]] = field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, label: str, kind: str, engine: str | None = None) -> Iterator[dict[str, Any]]:
        event: dict[str, Any] = {"label": label, "kind": kind, "engine": engine, "iteration": self.iteration}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        event["memory_start"] = memory_now(self.device)
        event["rss_start"] = rss_bytes()
        event["t_start"] = time.perf_counter() - self.sampler.start
        yield event
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        event["t_end"] = time.perf_counter() - self.sampler.start
        event["seconds"] = event["t_end"] - event["t_start"]
        event["memory_end"] = memory_now(self.device)
        event["rss_end"] = rss_bytes()
        if self.device.type == "cuda":
            event["memory_peak"] = torch.cuda.max_memory_allocated(self.device)
        else:
            event["memory_peak"] = max(event["memory_start"], event["memory_end"],
                                       self.sampler.peak_between(event["t_start"], event["t_end"]))
        event["engines"] = {name: engine_bytes(e, text=kind.startswith("train")) for name, e in self.engines.items()}
        self.events.append(event)


class Pass:
    """One run of the loop: with parking (`park` = "cpu" or "nvme") or without (`park` = None)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, park: str | None, nvme_root: Path | None,
                 tokens: torch.Tensor, tokenizer: CharTokenizer, log: bool = True) -> None:
        self.args, self.device, self.park_target, self.nvme_root = args, device, park, nvme_root
        self.log = log
        self.tokens = tokens
        self.cfg = gpt_config(args, tokenizer.vocab_size)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.rewarded = torch.zeros(tokenizer.vocab_size, dtype=torch.bool, device=device)
        self.rewarded[tokenizer.encode(REWARD_CHARS).to(device)] = True
        self.stats: list[dict[str, float]] = []

    # ---- parking ------------------------------------------------------------------
    def park(self, name: str, after: str) -> None:
        """`offload_states` of every state of one engine, timed, with the memory before and after.

        [Note: measuring a park]
        The fall is compared with the bytes the park moved (the states now on disk or in host memory).
        Two things would blur it, so they are taken out:
        * freed memory that glibc still holds from earlier phases (the generator's activations, a
          backward's temporaries): the park's own `malloc_trim` would hand it back too and count it as
          the park's. So the heap is trimmed *before* the first reading (on a GPU this changes nothing).
        * the contiguous_grad_buffer, which a park frees but does not move: it counts in the fall when a
          backward had touched its pages, and not when it was only recreated by a reload (a fresh
          `torch.empty` holds no resident pages yet). The fall may so exceed the moved bytes.
        On the CPU the memory is read right after `offload_states` returns, and again SETTLE_S later
        after another trim ("settled"). The two agree: zero3's disk writer drops its view of each
        chunk before the write's completion runs. (It once let go of the last chunk, and so of the
        whole buffer, just after the call returned: an mmap-backed buffer left RSS a moment late, a
        heap-backed one only at the next trim; tests/test_offload.py now checks it.)
        """
        if self.park_target is None:
            # Without parking, the heap is still trimmed where a park would trim it: freed memory glibc
            # keeps (activations, temporaries) then weighs the same in both passes, and the difference
            # between them is the parked states.
            accelerator.release_host_memory()
            return
        engine = self.engines[name]
        with self.rec.phase(f"park {name} (after {after})", "park", name) as event:
            before = engine_bytes(engine)
            accelerator.release_host_memory()  # see the Note
            memory_before = memory_now(self.device)
            start = time.perf_counter()
            engine.offload_states(device=self.park_target, pin_memory=True, non_blocking=False,
                                  nvme_path=self.nvme_root)
            accelerator.synchronize(self.device)
            event["move_seconds"] = time.perf_counter() - start
            memory_after = memory_now(self.device)
            after_bytes = engine_bytes(engine)
            event["moved_bytes"] = after_bytes["parked"] - before["parked"]  # now in host memory / on disk
            event["freed_bytes"] = before["resident"] - after_bytes["resident"]  # + the scratch bucket
            event["memory_change"] = memory_after - memory_before
        if self.device.type == "cpu":
            time.sleep(SETTLE_S)  # outside the phase: its seconds are the park's own
            accelerator.release_host_memory()
            event["memory_change_settled"] = memory_now(self.device) - memory_before

    def reload(self, name: str, before_phase: str) -> None:
        """`reload_states` of one engine, timed, with the memory before and after."""
        if self.park_target is None:
            return
        engine = self.engines[name]
        with self.rec.phase(f"reload {name} (for {before_phase})", "reload", name) as event:
            before = engine_bytes(engine)
            memory_before = memory_now(self.device)
            start = time.perf_counter()
            engine.reload_states(non_blocking=False)
            accelerator.synchronize(self.device)
            event["move_seconds"] = time.perf_counter() - start
            memory_after = memory_now(self.device)
            after_bytes = engine_bytes(engine)
            event["moved_bytes"] = before["parked"] - after_bytes["parked"]
            event["freed_bytes"] = before["resident"] - after_bytes["resident"]  # negative: memory taken back
            event["memory_change"] = memory_after - memory_before

    # ---- the loop -------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        args = self.args
        start_memory = memory_now(self.device)
        self.sampler = MemorySampler(self.device, args.sample_ms / 1000)
        self.engines: dict[str, zero3.ZeroEngine] = {}
        self.rec = PassRecorder(self.device, self.sampler, self.engines)
        with self.rec.phase("build", "build"):
            self.engines.update(build_engines(args, self.cfg, self.device))
            self.generator = build_generator(self.cfg, self.device)
        model_state_bytes = {name: e.model_state_bytes() for name, e in self.engines.items()}
        for name in ENGINES:
            self.park(name, "build")
        for iteration in range(args.iterations):
            self.rec.iteration = iteration
            self.stats.append(self.iteration(iteration))
            if self.log and self.rank == 0:
                s = self.stats[-1]
                print(f"[{'park ' + self.park_target if self.park_target else 'no parking'}] iteration "
                      f"{iteration + 1}/{args.iterations}: reward {s['reward']:.4f} kl {s['kl']:.4f} "
                      f"actor loss {s['actor_loss']:.4f} critic loss {s['critic_loss']:.4f}", flush=True)
        samples = self.sampler.stop()
        for engine in self.engines.values():
            engine.destroy()
        self.engines.clear()
        del self.generator
        gc.collect()
        accelerator.release_host_memory()
        return {"park": self.park_target, "start_memory": start_memory, "events": self.rec.events,
                "samples": samples, "stats": self.stats, "model_state_bytes": model_state_bytes}

    def prompts(self, iteration: int) -> torch.Tensor:
        """This rank's rows of the iteration's global batch of prompts (the same on every world size)."""
        rng = torch.Generator().manual_seed(self.args.seed * 1_000_003 + iteration)
        ids, _ = sample_global_batch(self.tokens, self.args.prompt_len, self.world * self.args.batch, rng)
        return ids[self.rank * self.args.batch : (self.rank + 1) * self.args.batch].to(self.device)

    def iteration(self, iteration: int) -> dict[str, float]:
        args, actor, critic, reference = self.args, *(self.engines[n] for n in ENGINES)
        p = args.prompt_len
        with self.rec.phase("generate", "generate") as event:
            start = time.perf_counter()
            event["streamed_bytes"] = load_generator(  # from the parked actor
                self.generator, actor, int(args.sync_bucket_mib * 2**20))
            event["stream_seconds"] = time.perf_counter() - start
            rng = torch.Generator(device=self.device).manual_seed(args.seed * 7919 + iteration * 104_729 + self.rank)
            seqs, logp_old = sample(self.generator, self.prompts(iteration), args.new_tokens, args.temperature, rng)
            reward = self.rewarded[seqs[:, p:]].float().mean(dim=1)

        self.reload("critic", "score")
        self.reload("reference", "score")
        with self.rec.phase("score", "score"), torch.no_grad():
            value = critic(seqs)[:, p - 1].float()  # the prompt's value: the baseline
            logp_ref = response_logprobs(reference(seqs)["logits"], seqs, p, args.temperature)
            kl = (logp_old - logp_ref).sum(dim=1)
            returns = reward - args.kl_coef * kl
            advantage = returns - value
        self.park("critic", "score")
        self.park("reference", "score")

        self.reload("actor", "train-actor")
        with self.rec.phase("train-actor", "train-actor"):
            for _ in range(args.epochs):
                logp = response_logprobs(actor(seqs)["logits"], seqs, p, args.temperature)
                ratio = torch.exp(logp - logp_old)
                clipped = ratio.clamp(1 - args.clip_ratio, 1 + args.clip_ratio)
                actor_loss = -torch.min(ratio * advantage[:, None], clipped * advantage[:, None]).mean()
                actor.backward(actor_loss)
                actor.step()
        self.park("actor", "train-actor")

        self.reload("critic", "train-critic")
        with self.rec.phase("train-critic", "train-critic"):
            for _ in range(args.epochs):
                critic_loss = (critic(seqs)[:, p - 1].float() - returns).pow(2).mean()
                critic.backward(critic_loss)
                critic.step()
        self.park("critic", "train-critic")

        # Means over every rank's rows (every rank has as many).
        stats = torch.stack([reward.mean(), kl.mean(), actor_loss.detach().float(), critic_loss.detach().float()])
        stats = stats.to(self.device)
        dist.all_reduce(stats)
        stats = (stats / self.world).tolist()
        return dict(zip(("reward", "kl", "actor_loss", "critic_loss"), stats))


# ------------------------------------------------------------------ plain copy rates


def plain_disk_rates(directory: Path, nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of one plain `write()` of `nbytes` to a new file in `directory` (no fsync: parked files are
    not fsynced either) and one unbuffered `readinto()` of it into a preallocated buffer, the baseline
    of benchmarks/offload.py; medians. Also, as a diagnostic, the same read into a buffer allocated
    inside the timed region, which pays the page faults of fresh memory as a reload must."""
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    into = torch.zeros(nbytes, dtype=torch.uint8)  # touched: no page faults in the timed reads
    path = directory / f"plain-copy-{os.getpid()}.bin"
    writes, reads, fresh_reads = [], [], []

    def read(buffer: torch.Tensor | None) -> float:
        start = time.perf_counter()
        target = torch.empty(nbytes, dtype=torch.uint8) if buffer is None else buffer
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(memoryview(target.numpy()))
        seconds = time.perf_counter() - start
        if got != nbytes:
            raise RuntimeError(f"plain read got {got} of {nbytes} bytes")
        return seconds

    try:
        for _ in range(repeats):
            start = time.perf_counter()
            with open(path, "wb") as f:
                written = f.write(memoryview(source.numpy()))
            writes.append(time.perf_counter() - start)
            if written != nbytes:
                raise RuntimeError(f"plain write wrote {written} of {nbytes} bytes")
            reads.append(read(into))
            fresh_reads.append(read(None))
            path.unlink()
    finally:
        path.unlink(missing_ok=True)
    return {"out_gbps": nbytes / statistics.median(writes) / 1e9, "in_gbps": nbytes / statistics.median(reads) / 1e9,
            "in_fresh_gbps": nbytes / statistics.median(fresh_reads) / 1e9}


def plain_host_rates(device: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of a plain tensor copy of `nbytes`: device -> pinned host (what a park to "cpu" does), and
    pinned host -> a new device tensor (what a reload does); medians. On the CPU: host -> host."""
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=accelerator.supports_pinned_memory(device))
    host.copy_(source)  # touched (and the copy path warmed)
    outs, ins = [], []
    for _ in range(repeats):
        accelerator.synchronize(device)
        start = time.perf_counter()
        host.copy_(source)
        accelerator.synchronize(device)
        outs.append(time.perf_counter() - start)
        start = time.perf_counter()
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        target.copy_(host)
        accelerator.synchronize(device)
        ins.append(time.perf_counter() - start)
        del target
    return {"out_gbps": nbytes / statistics.median(outs) / 1e9, "in_gbps": nbytes / statistics.median(ins) / 1e9}


def rate_summary(result: dict[str, Any], args: argparse.Namespace, device: torch.device,
                 nvme_root: Path | None) -> dict[str, Any]:
    """Per engine: the median park and reload GB/s of its moves, the plain copy of the same bytes (measured
    now, in this run), their ratios, and the memory fall of each park over the bytes it moved."""
    summary: dict[str, Any] = {}
    for name in ENGINES:
        parks = [e for e in result["events"] if e["kind"] == "park" and e["engine"] == name]
        reloads = [e for e in result["events"] if e["kind"] == "reload" and e["engine"] == name]
        moved = max((e["moved_bytes"] for e in parks), default=0)
        row: dict[str, Any] = {"moved_bytes": moved, "parks": len(parks), "reloads": len(reloads)}
        if moved and parks and reloads:
            row["park_gbps_each"] = [e["moved_bytes"] / e["move_seconds"] / 1e9 for e in parks]
            row["reload_gbps_each"] = [e["moved_bytes"] / e["move_seconds"] / 1e9 for e in reloads]
            row["park_gbps"] = statistics.median(row["park_gbps_each"])
            row["reload_gbps"] = statistics.median(row["reload_gbps_each"])
            if result["park"] == "nvme":
                assert nvme_root is not None
                plain = plain_disk_rates(nvme_root, moved, args.rate_repeats)
                row["plain"] = "one file write() / one readinto() of a preallocated buffer"
            else:
                plain = plain_host_rates(device, moved, args.rate_repeats)
                row["plain"] = "tensor copy device -> pinned host / pinned host -> new device tensor"
            row.update({f"plain_{key}": value for key, value in plain.items()})
            row["park_ratio"] = row["park_gbps"] / plain["out_gbps"]
            row["reload_ratio"] = row["reload_gbps"] / plain["in_gbps"]
        # The fall over the bytes moved (see the Note in Pass.park); a reload's rise likewise.
        row["fall_over_moved"] = [-e["memory_change"] / e["moved_bytes"] for e in parks if e["moved_bytes"]]
        row["fall_over_moved_settled"] = [-e["memory_change_settled"] / e["moved_bytes"] for e in parks
                                          if e["moved_bytes"] and "memory_change_settled" in e]
        row["rise_over_moved"] = [e["memory_change"] / e["moved_bytes"] for e in reloads if e["moved_bytes"]]
        for key in ("fall_over_moved", "fall_over_moved_settled"):
            row[f"min_{key}"] = min(row[key]) if row[key] else None
        summary[name] = row
    return summary


# ------------------------------------------------------------------ output


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def phase_rows(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """label -> the mean seconds over its occurrences and the memory of its last occurrence, in first-seen order."""
    rows: dict[str, dict[str, Any]] = {}
    for event in events:
        row = rows.setdefault(event["label"], {"seconds": [], "last": None, "kind": event["kind"]})
        row["seconds"].append(event["seconds"])
        row["last"] = event
    return rows


def _engine_cell(info: dict[str, Any]) -> str:
    parked = ", ".join(f"{where}: {_mib(n)}" for where, n in sorted(info["parked_on"].items()))
    if not parked:
        return _mib(info["resident"])
    return f"{_mib(info['resident'])} + {parked}" if info["resident"] else parked


def phase_table(park: dict[str, Any], plain: dict[str, Any] | None, device: torch.device) -> Table:
    memory = "device MiB" if device.type == "cuda" else "RSS MiB"
    what = f"parking to {park['park']}" if park["park"] else "no parking"
    if plain is not None:
        what += " (left) vs no parking (right)"
    table = Table(title=f"Phases on rank 0, {what}. Seconds: mean per iteration; memory: the last iteration; "
                        "engines: MiB of states in memory, or where they are parked")
    table.add_column("phase")
    table.add_column("n", justify="right")
    table.add_column("s", justify="right")
    table.add_column(memory, justify="right")
    table.add_column("peak", justify="right")
    for name in ENGINES:
        table.add_column(f"{name} MiB", justify="right")
    if plain is not None:
        table.add_column("| no park: s", justify="right")
        table.add_column(memory, justify="right")
        table.add_column("peak", justify="right")
    plain_rows = phase_rows(plain["events"]) if plain is not None else {}
    for label, row in phase_rows(park["events"]).items():
        last = row["last"]
        cells = [label, str(len(row["seconds"])), f"{statistics.mean(row['seconds']):.3f}",
                 _mib(last["memory_end"]), _mib(last["memory_peak"])]
        cells += [_engine_cell(last["engines"][name]) for name in ENGINES]
        if plain is not None:
            other = plain_rows.get(label)
            if other is None:
                cells += ["-", "-", "-"]
            else:
                cells += [f"{statistics.mean(other['seconds']):.3f}", _mib(other["last"]["memory_end"]),
                          _mib(other["last"]["memory_peak"])]
        table.add_row(*cells)
    return table


def rate_table(rates: dict[str, Any], park: str) -> Table:
    disk = park == "nvme"
    table = Table(title=f"Parking to {park} and reloading, rank 0, vs a plain "
                        f"{'file write / readinto' if disk else 'tensor copy'} of the same bytes in this run; "
                        "memory fall over the bytes parked")
    columns = ["engine", "MiB parked", "park GB/s", "plain GB/s", "ratio", "reload GB/s", "plain GB/s", "ratio"]
    if disk:
        columns.append("plain read, fresh buffer")
    columns += ["fall / parked (min)", "settled (min)"]
    for column in columns:
        table.add_column(column, justify="left" if column == "engine" else "right")

    def num(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for name, row in rates.items():
        cells = [name, _mib(row["moved_bytes"]), num(row.get("park_gbps")), num(row.get("plain_out_gbps")),
                 num(row.get("park_ratio")), num(row.get("reload_gbps")), num(row.get("plain_in_gbps")),
                 num(row.get("reload_ratio"))]
        if disk:
            cells.append(num(row.get("plain_in_fresh_gbps")))
        cells += [num(row["min_fall_over_moved"], 3), num(row["min_fall_over_moved_settled"], 3)]
        table.add_row(*cells)
    return table


def targets(ranks: list[dict[str, Any]], park: str) -> dict[str, Any]:
    """The issue's two targets, the worst over every rank and engine: park/reload GB/s over the plain copy
    (set for host memory, `--park cpu` beside a GPU), and the memory fall of a park over the bytes it parked
    (read when offload_states returns, and SETTLE_S later)."""
    rows = [row for rank in ranks for row in rank["rates"].values()]

    def worst(key: str) -> float | None:
        values = [row[key] for row in rows if row.get(key) is not None]
        return min(values) if values else None

    ratio = min((r for r in (worst("park_ratio"), worst("reload_ratio")) if r is not None), default=None)
    fall, settled = worst("min_fall_over_moved"), worst("min_fall_over_moved_settled")
    return {
        "rate_target": RATE_TARGET, "min_rate_ratio": ratio, "rate_target_applies": park == "cpu",
        "rate_met": None if ratio is None else ratio >= RATE_TARGET,
        "memory_target": MEMORY_TARGET, "min_fall_over_parked": fall, "min_fall_over_parked_settled": settled,
        "memory_met": None if fall is None else fall >= MEMORY_TARGET,
        "memory_met_settled": None if settled is None else settled >= MEMORY_TARGET,
    }


def target_lines(t: dict[str, Any]) -> list[str]:
    def num(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def verdict(met: bool | None) -> str:
        return "n/a" if met is None else ("met" if met else "NOT met")

    if t["rate_target_applies"]:
        rate = f"{verdict(t['rate_met'])}"
    else:
        rate = "the target is set for host memory, --park cpu beside a GPU; this run parks to disk"
    return [
        f"target: park/reload GB/s >= {RATE_TARGET} x the plain copy: worst {num(t['min_rate_ratio'], 2)} ({rate})",
        f"target: memory falls by >= {MEMORY_TARGET:.0%} of the parked bytes: worst "
        f"{num(t['min_fall_over_parked'], 3)} "
        f"when offload_states returns ({verdict(t['memory_met'])}), {num(t['min_fall_over_parked_settled'], 3)} "
        f"settled, {int(SETTLE_S * 1000)} ms and a trim later ({verdict(t['memory_met_settled'])})",
    ]


def saving_line(park: dict[str, Any], plain: dict[str, Any], device: torch.device) -> str:
    """Peak memory while the actor trains, with and without parking (rank 0, last iteration)."""
    def during(result: dict[str, Any]) -> dict[str, Any]:
        return [e for e in result["events"] if e["label"] == "train-actor"][-1]

    with_park, without = during(park), during(plain)
    what = "device memory" if device.type == "cuda" else "RSS"
    a, b = with_park["memory_peak"], without["memory_peak"]
    a0, b0 = a - park["start_memory"], b - plain["start_memory"]
    states_a, states_b = (sum(i["resident"] for i in e["engines"].values()) for e in (with_park, without))
    return (f"train-actor, peak {what}: {_mib(a)} MiB parking vs {_mib(b)} MiB not ({_mib(b - a)} MiB less); above "
            f"each pass's start: {_mib(a0)} vs {_mib(b0)} MiB ({_mib(b0 - a0)} MiB less); the engines' states in "
            f"memory (state_report): {_mib(states_a)} vs {_mib(states_b)} MiB ({_mib(states_b - states_a)} MiB less)")


PHASE_COLORS = {"build": "#dddddd", "generate": "#8ecae6", "score": "#ffb703", "train-actor": "#90be6d",
                "train-critic": "#43aa8b", "park": "#e76f51", "reload": "#9d4edd"}


def plot(path: Path, passes: list[dict[str, Any]], device: torch.device) -> bool:
    """Memory over time, one panel per pass (same scales), phases shaded, and a last panel with each
    iteration's weight sync (the actor's weights into the generator); False (with a message) without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print(f"matplotlib is not installed, so {path.name} is skipped: pip install zero3[plot] "
              "(or pip install matplotlib)", flush=True)
        return False
    fig, axes = plt.subplots(len(passes) + 1, 1, figsize=(13, 3.8 * len(passes) + 2.6), squeeze=False,
                             gridspec_kw={"height_ratios": [3.8] * len(passes) + [2.6]})
    what = "device memory allocated" if device.type == "cuda" else "process RSS"
    top = max(m for result in passes for rank in result["ranks"] for _, m in rank["samples"]) / 2**20
    right = max(t for result in passes for rank in result["ranks"] for t, _ in rank["samples"])
    for ax, result in zip(axes[:-1, 0], passes):
        for index, rank in enumerate(result["ranks"]):
            ax.plot([t for t, _ in rank["samples"]], [m / 2**20 for _, m in rank["samples"]], lw=1.2,
                    label=f"{what}, rank {index}")
        rank0 = result["ranks"][0]
        for event in rank0["events"]:
            ax.axvspan(event["t_start"], event["t_end"], color=PHASE_COLORS[event["kind"]], alpha=0.35, lw=0)
        # The engines' own accounting: their bytes in memory at each phase's end (rank 0).
        steps = [(0.0, 0.0)] + [(e["t_end"], sum(i["resident"] for i in e["engines"].values()) / 2**20)
                                for e in rank0["events"]]
        ax.step([t for t, _ in steps], [m for _, m in steps], where="post", color="black", ls="--", lw=1,
                label="engines' states in memory\n(state_report), rank 0")
        title = f"parking to {result['park']}" if result["park"] else "no parking"
        ax.set_title(f"{title}: memory over time", fontsize=10)
        ax.set_ylabel("MiB")
        ax.set_ylim(0, top * 1.1)
        ax.set_xlim(0, right * 1.01)
        handles, _ = ax.get_legend_handles_labels()
        shades = [Patch(color=color, alpha=0.35, label=kind) for kind, color in PHASE_COLORS.items()
                  if any(e["kind"] == kind for e in rank0["events"])]
        ax.legend(handles=handles + shades, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))
    axes[-2, 0].set_xlabel("seconds since the pass started")
    sync = axes[-1, 0]
    sync.xaxis.get_major_locator().set_params(integer=True)
    for result in passes:
        syncs = [e["stream_seconds"] for e in result["ranks"][0]["events"] if e["kind"] == "generate"]
        sync.plot(range(1, len(syncs) + 1), [1000 * t for t in syncs], marker="o",
                  label=f"parking to {result['park']}" if result["park"] else "no parking")
    sync.set_title("weight sync per iteration: the actor's weights into the generator (zero3.weights.load_into, "
                   "rank 0)", fontsize=10)
    sync.set_xlabel("iteration")
    sync.set_ylabel("ms")
    sync.set_ylim(bottom=0)
    sync.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ main


def init_distributed(args: argparse.Namespace) -> torch.device:
    """Join torchrun's rendezvous (env://), or become a world of one under plain `python`."""
    return comm.join_world(args.device)


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any] | None:
    """Both passes on every rank; rank 0 gets every rank's records and returns the JSON document."""
    resolve_defaults(args, device)
    rank = dist.get_rank()
    corpus = load_corpus()
    tokenizer = CharTokenizer(corpus)
    tokens = tokenizer.encode(corpus)
    park = None if args.park == "none" else args.park
    own_tmp = None
    nvme_root = args.nvme_path
    if park == "nvme" and nvme_root is None:
        own_tmp = Path(tempfile.mkdtemp(prefix=f"zero3-rlhf-rank{rank}-"))
        nvme_root = own_tmp
    if nvme_root is not None:
        nvme_root.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        p = gpt_config(args, tokenizer.vocab_size).num_parameters()
        print(f"rlhf_colocate: actor, critic and reference GPTs of {p:,} parameters each, "
              f"{dist.get_world_size()} rank(s) on {device}, {args.precision}, parking to "
              f"{park or 'nowhere'}{f' under {nvme_root}' if park == 'nvme' else ''}", flush=True)
        if park == "cpu" and device.type == "cpu":
            print("note: a CPU engine's states already live in host memory: offload_states(device='cpu') moves "
                  "nothing (use --park nvme to see memory fall)", flush=True)
    # The passes share one process, and the first one pays one-time costs that stay in it (torch's lazy
    # initialisation, thread arenas, the I/O threads' first use). A small warm-up pass (every phase, a
    # tiny model, results dropped) pays them first, so both passes start from the same footing. The pass
    # without parking then runs first: what it leaves behind raises the parking pass's memory, so the
    # saving shown is, if anything, understated.
    modes = [None, park] if park is not None and args.compare else [park]
    results: dict[str | None, dict[str, Any]] = {}
    try:
        if args.warmup:
            Pass(warmup_args(args), device, park, nvme_root, tokens, tokenizer, log=False).run()
        for mode in modes:
            result = Pass(args, device, mode, nvme_root, tokens, tokenizer).run()
            if mode is not None:
                result["rates"] = rate_summary(result, args, device, nvme_root)
            result["run_order"] = len(results)
            results[mode] = result
    finally:
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)
    shown = [results[m] for m in sorted(results, key=lambda m: m is None)]  # parking first
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, shown)
    if rank != 0:
        return None
    document: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "device": str(device), "world_size": dist.get_world_size(),
        "num_parameters": gpt_config(args, tokenizer.vocab_size).num_parameters(),
        "memory": "torch.cuda.memory_allocated" if device.type == "cuda" else "process RSS (/proc/self/statm)",
        "passes": [{"park": result["park"], "run_order": result["run_order"], "ranks": [ranks[i] for ranks in gathered]}
                   for i, result in enumerate(shown)],
    }
    if park is not None:
        document["targets"] = targets(document["passes"][0]["ranks"], park)
    return document


def report(document: dict[str, Any], device: torch.device, args: argparse.Namespace) -> None:
    """Print the tables (rank 0) and write the JSON and the PNG."""
    console = Console(width=None if sys.stdout.isatty() else 200, highlight=False)
    passes = document["passes"]
    first = passes[0]["ranks"][0]
    with_park = first if first["park"] is not None else None
    plain = next((p["ranks"][0] for p in passes if p["park"] is None), None)
    if with_park is not None:
        console.print(phase_table(with_park, plain, device))
        console.print(rate_table(with_park["rates"], with_park["park"]))
        for line in target_lines(document["targets"]):
            console.print(line)
        moving = sum(e["seconds"] for e in with_park["events"] if e["kind"] in ("park", "reload"))
        total = with_park["events"][-1]["t_end"]
        console.print(f"parking and reloading took {moving:.3f} s of the pass's {total:.3f} s ({moving / total:.1%}), "
                      "rank 0")
        if plain is not None:
            console.print(saving_line(with_park, plain, device))
        during = [e for e in with_park["events"] if e["label"] == "train-actor"][-1]
        console.print("\nstate_report() of each engine at the end of train-actor (rank 0, last iteration):")
        for name in ENGINES:
            console.print(f"{name}:", markup=False)
            console.print(during["engines"][name]["report"], markup=False)
    else:
        console.print(phase_table(plain, None, device))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / JSON_NAME).write_text(json.dumps(document, indent=1, default=str))
    wrote = plot(args.out / PNG_NAME, passes, device)
    console.print(f"wrote {args.out / JSON_NAME}" + (f" and {args.out / PNG_NAME}" if wrote else ""), markup=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = init_distributed(args)
    document = run(args, device)
    if document is not None:
        report(document, device, args)
    dist.barrier()  # rank 0 hosts the rendezvous store: leave together
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
