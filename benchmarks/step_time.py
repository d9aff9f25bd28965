#!/usr/bin/env python
"""By-hand step-time benchmark: zero3 against PyTorch FSDP2 (and DeepSpeed, if importable).

Not a test: nothing here asserts on timings. It trains the built-in GPT
(`zero3.models.gpt`) on the built-in corpus (`zero3.data`) at world size N on the
gloo backend, one thread per rank, once per engine:

* ``zero3``          -- ``zero3.Init`` + ``zero3.initialize``, bf16 (``--precision``), AdamW, ZeRO-3 with the
                        default ``stage3_param_persistence_threshold``;
* ``zero3-persist0`` -- the same with ``stage3_param_persistence_threshold: 0``
                        (every parameter partitioned, gathered on use);
* ``zero3-overlap``  -- with ``--offload-optimizer cpu`` only: ``zero3`` with ``super_offload: true`` (the
                        host step overlapped with the backward) and ``sub_group_size`` 1e7;
* ``zero3-ckpt``     -- ``zero3`` with automatic checkpoints after every step (the config's
                        ``checkpoint``: ``interval_steps: 1``, ``async_save: true``, ``keep_last: 2``, into a
                        temporary directory): what checkpointing every step costs a step (issue 39's
                        target: at most 5%; ``benchmarks/checkpoint.py --overhead`` runs this pair);
* ``fsdp2``          -- ``fully_shard`` on each transformer block, then on the root, with
                        ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``,
                        ``torch.optim.AdamW(foreach=True)`` and ``clip_grad_norm_(1.0)``;
* ``deepspeed``      -- the zero3 config handed to DeepSpeed, only if ``import deepspeed``
                        works (it is not a dependency; nothing installs it);
* ``ddp``            -- plain PyTorch: ``DistributedDataParallel`` (no wrapper at world size 1), fp32
                        parameters under ``torch.autocast`` in the benchmark's precision, fused
                        ``torch.optim.AdamW`` and ``clip_grad_norm_(1.0)``: the floor an engine is held to.

Every engine starts from the same init (same seed; ``zero3.Init`` reproduces the
single-process init) and sees the same global batches (a ``torch.Generator``
seeded per step draws the global batch, each rank takes its rows), so their
losses are comparable.

Each engine runs in its own freshly launched set of worker processes
(``torch.distributed.launcher.api.elastic_launch``, the machinery behind
torchrun), so each engine's peak memory is its own: RSS on the CPU,
``torch.cuda.max_memory_allocated`` on a GPU. ``--rounds N`` runs every engine
N times, alternating (engine order rotated each round), so a machine's drift
lands on all of them; an engine's figure is the median over its runs of each
run's median step. Per step: ``dist.barrier()``, then the step is timed with
``time.perf_counter`` (after ``torch.cuda.synchronize`` on a GPU); a step's
time is the slowest rank's. Results: a rich table, zero3's ratio to every
other engine (time and peak memory), and JSON at ``--out``. The same command
runs on a CUDA machine (``--device cuda``, or auto: nccl, one GPU per rank).

    python benchmarks/step_time.py                 # defaults: about 1-2 minutes
    python benchmarks/step_time.py --profile       # also cProfile rank 0 of zero3
    python benchmarks/step_time.py --breakdown     # also torch.profiler: how zero3's step splits
    python benchmarks/step_time.py --memory        # also where each engine's resident memory goes
    python benchmarks/step_time.py --engines zero3,fsdp2,deepspeed,ddp --n-layer 6 --n-embd 512 --rounds 5
    python benchmarks/step_time.py --engines zero3,deepspeed --offload-optimizer cpu --precision fp32 \
        --n-layer 8 --n-embd 512                   # ZeRO-Offload against DeepSpeed's (where it imports)
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import logging
import os
import shutil
import platform
import pstats
import resource
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from provenance import provenance  # benchmarks/provenance.py, beside this script
from zero3.accelerator import host_heap_bytes
from zero3.cli import non_negative_int, positive_int
from zero3.data import CharTokenizer, load_corpus, sample_global_batch
from zero3.models.gpt import GPT, GPTConfig

ENGINES = ("zero3", "zero3-persist0", "zero3-lean", "zero3-ckpt", "zero3-overlap", "fsdp2", "deepspeed", "ddp")
# zero3's host step overlapped with the backward: sub-groups this large land several to a backward.
OVERLAP_SUB_GROUP_SIZE = 10_000_000
_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "step_time.json"


# ------------------------------------------------------------------------ the job


@dataclass(frozen=True)
class Job:
    """Everything a worker needs; pickled to each spawned process."""

    engine: str
    model: GPTConfig
    micro_batch: int
    steps: int
    warmup: int
    seed: int
    profile: bool = False
    profile_out: str = ""
    offload_optimizer: str = "none"
    precision: str = "bf16"
    reduce_bucket_size: int | None = None
    prefetch_bucket_size: int | None = None
    device: str = "cpu"
    breakdown: bool = False
    breakdown_out: str = ""
    trace_out: str = ""
    memory: bool = False  # sample RSS through the steps (PeakSampler)
    memory_timeline: str = ""  # a directory: each rank's sampled timeline (PeakSampler)
    # The config's optimizer section, as JSON (benchmarks/optimizers.py); "" is AdamW.
    optimizer: str = ""


ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}


def ds_config(
    micro_batch: int, persistence_threshold: int | None, offload_optimizer: str = "none", precision: str = "bf16",
    reduce_bucket_size: int | None = None, optimizer: dict[str, Any] | None = None,
    prefetch_bucket_size: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed-style config used by zero3 (and by DeepSpeed, if present)."""
    zero: dict[str, Any] = {"stage": 3}
    if persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    if reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = reduce_bucket_size
    if prefetch_bucket_size is not None:
        zero["stage3_prefetch_bucket_size"] = prefetch_bucket_size
    if offload_optimizer != "none":
        # ZeRO-Offload: fp32 masters and moments on the host, the step there (DeepSpeedCPUAdam in DeepSpeed).
        zero["offload_optimizer"] = {"device": offload_optimizer}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": optimizer if optimizer is not None else ADAMW,
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": zero,
    }


def _batch_seed(seed: int, step: int) -> int:
    # The same spread as zero3/cli/worker.py (`_batch_seed`).
    return seed * 1_000_003 + step


def _tensor_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard
    return local.numel() * local.element_size()


# ------------------------------------------------------------ where memory goes

def memory_snapshot() -> dict[str, int]:
    """This process's resident memory and what glibc's allocator holds, at one moment (Linux)."""
    snapshot: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                snapshot[key] = int(value.split()[0]) * 1024
            elif key == "Threads":
                snapshot[key] = int(value)
    except OSError:
        pass
    heap = host_heap_bytes()  # glibc's allocator (None elsewhere: RSS and threads only)
    if heap is not None:
        snapshot.update(heap_in_use=heap["in_use"], heap_free=heap["free"], mmapped=heap["mmapped"])
    return snapshot


class PeakSampler:
    """Samples this process's RSS every `interval_s` from a thread, and which phase of the step it is in
    (set by the step functions through `phase`): the peak, the phase it fell in, and glibc's heap at that
    moment (in use, freed but kept, mapped apart). The GIL is released inside torch's ops, so the samples
    land inside the forward, the backward and the step, not only between them."""

    phase = "outside a step"

    def __init__(self, interval_s: float = 0.002, timeline: str = "") -> None:
        import threading

        self.interval_s = interval_s
        # With `timeline`: every 10th sample's (seconds, phase, RSS, heap in use, heap free, mmapped) too,
        # written there as JSON when the sampler stops.
        self.timeline_path = timeline
        self.timeline: list[tuple[float, str, int, int, int, int]] = []
        self.started = time.perf_counter()
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self.by_phase: dict[str, int] = {}
        self.at_peak: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * self.page

    def _run(self) -> None:
        count = 0
        while not self._stop.wait(self.interval_s):
            rss, phase = self._rss(), PeakSampler.phase
            count += 1
            if self.timeline_path and count % 10 == 0:
                heap = host_heap_bytes() or {}
                self.timeline.append((time.perf_counter() - self.started, phase, rss, heap.get("in_use", 0),
                                      heap.get("free", 0), heap.get("mmapped", 0)))
            if rss > self.by_phase.get(phase, 0):
                self.by_phase[phase] = rss
            if rss > self.peak:
                self.peak = rss
                if rss > self.at_peak.get("rss", 0) + 2**20:  # glibc's figures: only on a new MiB
                    heap = host_heap_bytes() or {}
                    self.at_peak = {"rss": rss, "phase": phase, **heap}

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        if self.timeline_path:
            Path(self.timeline_path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.timeline_path).write_text(json.dumps(self.timeline))
        return {"peak": self.peak, "by_phase": self.by_phase, "at_peak": self.at_peak}


def _phase(name: str) -> None:
    PeakSampler.phase = name


# ------------------------------------------------------------------ the engines
#
# Each builder returns (step, state_bytes, close): step(x, y) -> loss (detached),
# state_bytes() -> {name: bytes on this rank}, close() tears the engine down.

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _torch_step(
    forward: torch.nn.Module, model: torch.nn.Module, opt: torch.optim.Optimizer, autocast: torch.dtype | None,
) -> StepFn:
    """One training step of a plain torch optimizer (FSDP2, DDP): `forward` is the wrapped model,
    `autocast` the dtype its forward runs under (None: as the model is)."""
    device_type = next(model.parameters()).device.type

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # zero_grad first, so the grads are still there for state_bytes().
        opt.zero_grad(set_to_none=True)
        _phase("forward")
        with torch.autocast(device_type, dtype=autocast or torch.float32, enabled=autocast is not None):
            out = forward(x, y)
        _phase("backward")
        out["loss"].backward()
        _phase("step")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _phase("outside a step")
        return out["loss"].detach()

    return step


def _torch_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameters, gradients and optimizer state of a plain torch optimizer (DTensors: the shard)."""
    params = list(model.parameters())
    states = {
        "params": sum(_tensor_bytes(p) for p in params),
        "grads": sum(_tensor_bytes(p.grad) for p in params),
        "optim_states": sum(
            _tensor_bytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        ),
    }
    states["total"] = sum(states.values())
    return states


def _engine_step(engine: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One training step through a DeepSpeed-shaped engine (zero3 and DeepSpeed share the API)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _phase("forward")
        out = engine(x, y)
        _phase("backward")
        engine.backward(out["loss"])
        _phase("step")
        engine.step()
        _phase("outside a step")
        return out["loss"].detach()

    return step


def _device(job: Job) -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if job.device == "cuda" else torch.device("cpu")


def _build_zero3(job: Job, threshold: int | None, checkpoints: bool = False, overlapped: bool = False,
                 lean: bool = False):
    import zero3

    cfg = ds_config(job.micro_batch, threshold, job.offload_optimizer, job.precision, job.reduce_bucket_size,
                    json.loads(job.optimizer) if job.optimizer else None, job.prefetch_bucket_size)
    cfg["wall_clock_breakdown"] = job.breakdown
    if lean:  # no resident 16-bit shards: each gather casts from the fp32 masters (issue 43 item 1)
        cfg["zero_optimization"]["lean_memory"] = True
    if overlapped:
        cfg["zero_optimization"]["offload_optimizer"]["super_offload"] = True
        cfg["zero_optimization"]["sub_group_size"] = OVERLAP_SUB_GROUP_SIZE
    checkpoint_dir = None
    if checkpoints:
        # One directory for the job's ranks: made by rank 0, named by the job's launch (the same on every rank).
        checkpoint_dir = Path(tempfile.gettempdir()) / f"zero3-step-time-ckpt-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
        cfg["checkpoint"] = {"dir": str(checkpoint_dir), "interval_steps": 1, "async_save": True, "keep_last": 2}
    torch.manual_seed(job.seed)
    with zero3.Init(config=cfg, device=_device(job)):
        model = GPT(job.model)
    engine, _, _, _ = zero3.initialize(
        model=model, model_parameters=model.parameters(), config=cfg, device=_device(job),
    )
    step = _engine_step(engine)

    def state_bytes() -> dict[str, int]:
        return {k: int(v) for k, v in engine.model_state_bytes().items()}

    def close() -> None:
        if checkpoint_dir is not None:
            engine.wait_for_checkpoint()
            dist.barrier()
            if os.environ.get("RANK", "0") == "0":
                print(f"zero3-ckpt: {len(list(checkpoint_dir.glob('global_step*')))} checkpoints kept of "
                      f"{engine.global_steps} saved", flush=True)
                shutil.rmtree(checkpoint_dir, ignore_errors=True)
        early = engine.optimizer.early  # zero3-overlap: what the host steps begun in the backward came to
        if early is not None and os.environ.get("RANK", "0") == "0":
            stats = early.stats
            why = f" {stats.undone_reasons}" if stats.undone_reasons else ""
            print(f"zero3 rank 0: sub-groups stepped early and kept {stats.kept}, undone {stats.undone}{why}; "
                  f"backwards that stepped nothing early (the step before was clipped or not finite): "
                  f"{stats.skipped}", flush=True)
        heap = engine.parts.reducer.heap_return  # on the CPU: the heap the backward freed, handed back (host_heap)
        if heap.enabled and os.environ.get("RANK", "0") == "0":
            print(f"zero3 rank 0: {heap.calls} heap hand-backs in {heap.seconds * 1e3:.0f} ms "
                  f"over {job.warmup + job.steps} steps", flush=True)
        engine.destroy()

    return step, state_bytes, close


def _build_fsdp2(job: Job):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(job.seed)
    model = GPT(job.model).to(_device(job))
    mesh = init_device_mesh(_device(job).type, (dist.get_world_size(),))
    dtype = torch.bfloat16 if job.precision == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, foreach=True)
    step = _torch_step(model, model, opt, autocast=None)  # the mixed-precision policy casts

    def state_bytes() -> dict[str, int]:
        # This rank's shards (DTensor local tensors): fp32 params, their fp32 grads
        # (reduced in bf16, then cast back to the param dtype) and Adam's moments.
        return _torch_state_bytes(model, opt)

    return step, state_bytes, lambda: None


def _build_deepspeed(job: Job):
    import deepspeed  # noqa: F401  (only reached when importable)

    cfg = ds_config(job.micro_batch, None, job.offload_optimizer, job.precision, job.reduce_bucket_size,
                    json.loads(job.optimizer) if job.optimizer else None, job.prefetch_bucket_size)
    if cfg["optimizer"]["type"].lower() == "muon":
        cfg["zero_optimization"]["reduce_scatter"] = False  # DeepSpeed refuses Muon with it
    torch.manual_seed(job.seed)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = GPT(job.model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    step = _engine_step(engine)

    def state_bytes() -> dict[str, int]:
        return {}  # DeepSpeed has no single accessor for this

    return step, state_bytes, getattr(engine, "destroy", lambda: None)


def _build_ddp(job: Job):
    """Plain PyTorch data parallelism: every rank holds the whole model and optimizer."""
    from torch.nn.parallel import DistributedDataParallel

    device = _device(job)
    torch.manual_seed(job.seed)
    model = GPT(job.model).to(device)
    wrapped = model
    if dist.get_world_size() > 1:
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    step = _torch_step(wrapped, model, opt, autocast=torch.bfloat16 if job.precision == "bf16" else None)

    def state_bytes() -> dict[str, int]:
        return _torch_state_bytes(model, opt)

    return step, state_bytes, lambda: None


def _build(job: Job):
    if job.engine == "zero3":
        return _build_zero3(job, None)
    if job.engine == "zero3-persist0":
        return _build_zero3(job, 0)
    if job.engine == "zero3-lean":
        return _build_zero3(job, None, lean=True)
    if job.engine == "zero3-ckpt":
        return _build_zero3(job, None, checkpoints=True)
    if job.engine == "zero3-overlap":
        return _build_zero3(job, None, overlapped=True)
    if job.engine == "fsdp2":
        return _build_fsdp2(job)
    if job.engine == "deepspeed":
        return _build_deepspeed(job)
    if job.engine == "ddp":
        return _build_ddp(job)
    raise ValueError(job.engine)


# ------------------------------------------------------------------- the worker


def worker(job: Job) -> dict[str, Any]:
    """Runs in every spawned process (module level, so it can be pickled)."""
    torch.set_num_threads(1)
    memory: dict[str, Any] = {"imported": memory_snapshot()}
    sampler = None
    if job.memory:
        timeline = ""
        if job.memory_timeline:
            timeline = str(Path(job.memory_timeline) / f"{job.engine}_rank{os.environ.get('RANK', '0')}.json")
        sampler = PeakSampler(timeline=timeline)
    device = _device(job)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    memory["process group"] = memory_snapshot()
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = CharTokenizer(load_corpus()).encode(load_corpus())
    step, state_bytes, close = _build(job)
    memory["built"] = memory_snapshot()

    generator = torch.Generator()
    rows = job.micro_batch
    times: list[float] = []
    losses: list[float] = []
    profiler = cProfile.Profile() if job.profile and rank == 0 else None
    tracer = _Breakdown() if job.breakdown and rank == 0 else None
    cpu_at_start: list[int] | None = None
    for i in range(job.warmup + job.steps):
        if i == job.warmup and rank == 0:
            cpu_at_start = _machine_cpu_ticks()
        generator.manual_seed(_batch_seed(job.seed, i))
        x_all, y_all = sample_global_batch(tokens, job.model.block_size, rows * world, generator)
        x = x_all[rank * rows : (rank + 1) * rows].to(device)
        y = y_all[rank * rows : (rank + 1) * rows].to(device)
        timed = i >= job.warmup
        if timed and i == job.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _synchronize(device)
        dist.barrier()
        if profiler is not None and timed:
            profiler.enable()
        if tracer is not None and timed:
            tracer.start()
        t0 = time.perf_counter()
        loss = step(x, y)
        _synchronize(device)
        elapsed = time.perf_counter() - t0
        if tracer is not None and timed:
            tracer.stop(elapsed)
        if profiler is not None and timed:
            profiler.disable()
        losses.append(float(loss))
        if timed:
            times.append(elapsed)
        if i == 0:
            memory["first step"] = memory_snapshot()
    cpu_split = _cpu_split(cpu_at_start, _machine_cpu_ticks()) if cpu_at_start is not None else None
    memory["last step"] = memory_snapshot()
    if sampler is not None:
        memory["sampled"] = sampler.stop()

    if job.trace_out and rank == 0:
        _trace(job, step, tokens, device, world)
        if device.type == "cuda":
            _peak_memory_sites(job, step, tokens, device, world)
    states = state_bytes()
    if profiler is not None:
        profiler.dump_stats(job.profile_out)
    breakdown = tracer.split() if tracer is not None else None
    close()
    dist.barrier()
    dist.destroy_process_group()
    return {
        "rank": rank,
        "step_times_s": times,
        "losses": losses,
        "model_state_bytes": states,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "breakdown": breakdown,
        "memory": memory,
        "cpu_split": cpu_split,
    }


_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _machine_cpu_ticks() -> list[int] | None:
    """The whole machine's CPU time so far, by kind (Linux's /proc/stat); None elsewhere."""
    try:
        with open("/proc/stat") as stat:
            return [int(field) for field in stat.readline().split()[1 : 1 + len(_CPU_FIELDS)]]
    except (OSError, ValueError):
        return None


def _cpu_split(start: list[int] | None, end: list[int] | None) -> dict[str, float] | None:
    """Each kind's share of the machine's CPU time between two readings. On a VM, `steal` is time the
    hypervisor ran something else on this machine's CPUs (its own disk or network work among it)."""
    if start is None or end is None:
        return None
    spent = [b - a for a, b in zip(start, end)]
    total = sum(spent)
    return {kind: ticks / total for kind, ticks in zip(_CPU_FIELDS, spent)} if total else None


def _trace(job: Job, step: StepFn, tokens: torch.Tensor, device: torch.device, world: int) -> None:
    """Five more steps under torch.profiler (CPU, and CUDA on a GPU), after the timed ones so their
    timing is untouched: the ops table by self CPU time and by device time, and the device's busy
    time per step beside the wall time (the rest is the device waiting for the host)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    generator = torch.Generator()
    steps = 5
    with profile(activities=activities) as prof:
        _synchronize(device)
        t0 = time.perf_counter()
        for i in range(steps):
            generator.manual_seed(_batch_seed(job.seed, 10_000 + i))
            x_all, y_all = sample_global_batch(tokens, job.model.block_size, job.micro_batch * world, generator)
            step(x_all[: job.micro_batch].to(device), y_all[: job.micro_batch].to(device))
        _synchronize(device)
        wall_ms = (time.perf_counter() - t0) / steps * 1e3
    averages = prof.key_averages()
    lines = [f"{job.engine}: {steps} profiled steps, wall {wall_ms:.2f} ms per step"]
    if device.type == "cuda":
        # Kernel rows only: an op's row counts its kernels' time again.
        busy_ms = sum(e.self_device_time_total for e in averages if e.device_type.name == "CUDA") / 1e3 / steps
        lines.append(f"device busy (sum of kernel times) {busy_ms:.2f} ms per step = {busy_ms / wall_ms:.1%} of wall")
        lines.append(averages.table(sort_by="self_device_time_total", row_limit=25))
    lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=40))
    Path(job.trace_out).write_text("\n".join(lines) + "\n")


def _peak_memory_sites(job: Job, step: StepFn, tokens: torch.Tensor, device: torch.device, world: int) -> None:
    """Two more steps with CUDA's allocation history recorded: what is allocated at the highest point, by
    the code that allocated it (the innermost frame outside torch), written to <engine>_peak_memory.txt
    beside the trace. What was allocated before (the model state, persistent buffers) is one line."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    generator = torch.Generator()
    try:
        for i in range(2):
            generator.manual_seed(_batch_seed(job.seed, 20_000 + i))
            x_all, y_all = sample_global_batch(tokens, job.model.block_size, job.micro_batch * world, generator)
            step(x_all[: job.micro_batch].to(device), y_all[: job.micro_batch].to(device))
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][device.index]
    peak, peak_index, by_site = peak_allocations(events, base)
    lines = [
        f"{job.engine}: peak {peak / 2**20:,.1f} MiB over two steps (max_memory_allocated "
        f"{torch.cuda.max_memory_allocated(device) / 2**20:,.1f}); {base / 2**20:,.1f} MiB allocated before them",
        f"the allocation that reached it: {_site(events[peak_index].get('frames', [])) if peak_index >= 0 else '-'}",
        "alive at the peak, by allocating site (MiB):",
    ]
    for where, size in sorted(by_site.items(), key=lambda item: -item[1])[:25]:
        lines.append(f"  {size / 2**20:>10,.1f}  {where}")
    path = Path(job.trace_out).with_name(f"{job.engine}_peak_memory.txt")
    path.write_text("\n".join(lines) + "\n")


def _site(frames: list[dict[str, Any]]) -> str:
    """Where an allocation was made: the innermost frame outside torch, and the innermost frame's function."""
    own = [f for f in frames if "/torch/" not in f["filename"] and "<" not in f["filename"]]
    chosen = own[0] if own else (frames[0] if frames else {"filename": "?", "line": 0, "name": "?"})
    inner = frames[0]["name"] if frames else "?"
    return f"{Path(chosen['filename']).name}:{chosen['line']} {chosen['name']} ({inner})"


def peak_allocations(events: list[dict[str, Any]], base: int) -> tuple[int, int, dict[str, int]]:
    """Replays a CUDA allocation trace (torch.cuda.memory._snapshot()'s device_traces) from `base` bytes
    allocated: the highest point, the index of the event that reached it, and the bytes alive then by
    allocating site. A block freed in the trace but made before it counts against `base`."""

    def replay(until: int | None) -> tuple[int, int, dict[int, tuple[int, list]]]:
        live: dict[int, tuple[int, list]] = {}
        current = peak = base
        peak_index = -1
        for index, event in enumerate(events[:until]):
            if event["action"] == "alloc":
                live[event["addr"]] = (event["size"], event.get("frames", []))
                current += event["size"]
                if current > peak:
                    peak, peak_index = current, index
            elif event["action"] == "free_completed":
                held = live.pop(event["addr"], None)
                current -= held[0] if held is not None else event["size"]
        return peak, peak_index, live

    peak, peak_index, _ = replay(None)
    _, _, at_peak = replay(peak_index + 1)  # the blocks alive right after the peak's allocation
    by_site: dict[str, int] = {}
    for size, frames in at_peak.values():
        by_site[_site(frames)] = by_site.get(_site(frames), 0) + size
    return peak, peak_index, by_site


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Profiler event names by part of a step. Communication: the collectives and their waits (gloo runs
# them on its own threads; what this thread spends is the wait). Optimizer: torch's step, which zero3
# and every baseline call. Everything else torch runs is compute; the wall time no op accounts for is
# Python: the engine's hooks and bookkeeping, and the model's own Python.
_COMM_MARKERS = ("c10d", "gloo", "nccl", "all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce",
                 "barrier", "record_param_comms", "wait")


class _Breakdown:
    """torch.profiler over the timed steps of rank 0: time per part of a step (see the markers above)."""

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.steps = 0
        self.parts: dict[str, float] = {"compute": 0.0, "communication": 0.0, "optimizer": 0.0}
        self._profiler: Any = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU])
        self._profiler.__enter__()

    def stop(self, wall_s: float) -> None:
        self._profiler.__exit__(None, None, None)
        self.wall_s += wall_s
        self.steps += 1
        events = self._profiler.events()
        # The training thread: the one that ran the most ops (autograd's and gloo's threads run fewer).
        main_thread = collections.Counter(event.thread for event in events).most_common(1)[0][0]
        optimizer_ids = set()
        for event in events:
            if event.name.startswith("Optimizer.step#"):
                optimizer_ids.add(event.id)
        for event in events:
            if event.device_type.name != "CPU" or event.name.startswith("Optimizer.step#"):
                continue
            if event.thread != main_thread:
                continue  # gloo's and autograd's worker threads overlap this one: their time is not the step's
            seconds = event.self_cpu_time_total / 1e6
            if _under(event, optimizer_ids):
                self.parts["optimizer"] += seconds
            elif any(marker in event.name.lower() for marker in _COMM_MARKERS):
                self.parts["communication"] += seconds
            elif event.name.startswith("aten::") or event.name.startswith("autograd::"):
                self.parts["compute"] += seconds
        self._profiler = None

    def split(self) -> dict[str, float]:
        per_step = {name: seconds / max(self.steps, 1) * 1e3 for name, seconds in self.parts.items()}
        wall = self.wall_s / max(self.steps, 1) * 1e3
        per_step["python_hooks_other"] = max(wall - sum(per_step.values()), 0.0)
        per_step["profiled_step"] = wall
        return {f"{name}_ms": value for name, value in per_step.items()}


def _under(event: Any, ids: set[int]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.id in ids:
            return True
        parent = parent.cpu_parent
    return False


# ------------------------------------------------------------------- the launch


def launch(job: Job, nproc: int) -> dict[int, dict[str, Any]]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    log_dir = tempfile.mkdtemp(prefix=f"zero3-bench-{job.engine}-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id=f"bench-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        monitor_interval=0.2,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects={r: Std.ALL for r in range(1, nproc)}),
    )
    return elastic_launch(config, worker)(job)


# ------------------------------------------------------------------ reporting


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(per_rank: dict[int, dict[str, Any]], tokens_per_step: int) -> dict[str, Any]:
    ranks = [per_rank[r] for r in sorted(per_rank)]
    # A step takes as long as its slowest rank.
    step_s = [max(vals) for vals in zip(*(r["step_times_s"] for r in ranks))]
    losses = [statistics.fmean(vals) for vals in zip(*(r["losses"] for r in ranks))]
    peak_device = [r.get("peak_device_bytes") for r in ranks]
    return {
        "median_ms": statistics.median(step_s) * 1e3,
        "p90_ms": _percentile(step_s, 90) * 1e3,
        "mean_ms": statistics.fmean(step_s) * 1e3,
        "min_ms": min(step_s) * 1e3,
        "tokens_per_s": tokens_per_step * len(step_s) / sum(step_s),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses,
        "step_times_ms": [t * 1e3 for t in step_s],
        "per_rank_step_times_ms": [[t * 1e3 for t in r["step_times_s"]] for r in ranks],
        "model_state_bytes": [r["model_state_bytes"] for r in ranks],
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
        "peak_device_bytes": peak_device if any(b is not None for b in peak_device) else None,
        "breakdown": ranks[0].get("breakdown"),
        "memory": [r.get("memory") for r in ranks],
        "cpu_split": ranks[0].get("cpu_split"),
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's alternated runs: the median of the runs' medians, the largest peak; each run kept."""
    combined = dict(runs[-1])
    combined["median_ms"] = statistics.median(run["median_ms"] for run in runs)
    combined["run_medians_ms"] = [run["median_ms"] for run in runs]
    combined["peak_memory_bytes"] = statistics.median(_peak(run) for run in runs)
    combined["run_peaks_bytes"] = [_peak(run) for run in runs]
    steals = [run["cpu_split"]["steal"] for run in runs if run.get("cpu_split")]
    combined["steal_share"] = statistics.median(steals) if steals else None
    combined["runs"] = runs
    return combined


def _peak(run: dict[str, Any]) -> int:
    """Peak memory of a run: the largest rank's device peak on a GPU, else the largest rank's RSS."""
    device = run.get("peak_device_bytes")
    return max(device) if device else max(run["peak_rss_bytes"])


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def print_report(results: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    meta = results["setup"]
    memory = "peak GPU MiB (max allocated)" if meta["device"] == "cuda" else "peak RSS MiB"
    table = Table(
        title=(
            f"Step time, GPT {meta['num_parameters']:,} params (n_layer {meta['n_layer']}, "
            f"n_embd {meta['n_embd']}, block {meta['block_size']}), micro batch {meta['micro_batch']} x "
            f"{meta['nproc']} ranks, {meta['device']}, {meta['precision']}, {meta['warmup']} warmup + "
            f"{meta['steps']} timed steps, {meta['rounds']} alternated run(s)"
        ),
        caption="step = slowest rank's wall time after a per-step barrier; median = median over runs of each "
        "run's median; loss = mean over ranks (last run); memory = largest rank's peak, median over runs",
    )
    for name, justify in [("engine", "left"), ("median ms", "right"), ("run medians ms", "right"),
                          ("tokens/s", "right"), ("first loss", "right"), ("last loss", "right"),
                          ("model state MiB", "right"), (memory, "right")]:
        table.add_column(name, justify=justify)
    notes: list[str] = []
    for name, res in results["engines"].items():
        if "error" in res:
            table.add_row(name, *(["-"] * 7))
            notes.append(f"{name}: {res['error']}")
            continue
        if res.get("failed_runs"):
            notes.append(f"{name}: {len(res['failed_runs'])} run(s) failed, the figures are the other runs': "
                         f"{res['failed_runs'][0]}")
        totals = [s.get("total") for s in res["model_state_bytes"]]
        table.add_row(
            name,
            f"{res['median_ms']:.1f}",
            " ".join(f"{m:.0f}" for m in res["run_medians_ms"]),
            f"{res['tokens_per_s']:,.0f}",
            f"{res['first_loss']:.4f}",
            f"{res['last_loss']:.4f}",
            " / ".join(_mib(t) if t is not None else "-" for t in totals),
            _mib(res["peak_memory_bytes"]),
        )
    console.print(table)
    for note in notes:
        console.print(note, markup=False, highlight=False)
    steals = {name: res["steal_share"] for name, res in results["engines"].items() if res.get("steal_share") is not None}
    if any(share >= 0.005 for share in steals.values()):
        console.print("CPU time the hypervisor took from this machine during the timed steps (steal, median over "
                      "runs): " + ", ".join(f"{name} {100 * share:.1f}%" for name, share in steals.items()),
                      markup=False, highlight=False)
    for key, ratio in results["ratios"].items():
        console.print(f"{key}: [bold]{ratio:.3f}[/bold]")
    for name, res in results["engines"].items():
        if res.get("breakdown"):
            parts = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in res["breakdown"].items())
            console.print(f"{name} rank 0, ms per profiled step (torch.profiler inflates it): {parts}")


MEMORY_PHASES = ("imported", "process group", "built", "first step", "last step")


def print_memory(results: dict[str, Any], console: Any) -> None:
    """Where each engine's resident memory goes, from its last run's rank with the highest peak RSS: RSS
    after each phase, then at the last step what glibc's heap holds in use and free (kept, not returned),
    what it mmapped apart, the threads, and the model state's own bytes."""
    from rich.table import Table

    phases = Table(title="Resident memory (MiB) after each phase: the rank with the highest peak, last run")
    phases.add_column("engine")
    for column in (*MEMORY_PHASES, "peak"):
        phases.add_column(column, justify="right")
    held = Table(title="At the last step (MiB): glibc's heap, threads, and the model state's bytes")
    for column in ("engine", "RSS", "heap in use", "heap free, kept", "mmapped apart", "threads",
                   "model state", "RSS - state"):
        held.add_column(column, justify="left" if column == "engine" else "right")
    for name, res in results["engines"].items():
        if "error" in res or not res.get("memory") or not res["memory"][0]:
            continue
        worst = max(range(len(res["peak_rss_bytes"])), key=lambda r: res["peak_rss_bytes"][r])
        memory = res["memory"][worst]
        phases.add_row(name, *[_mib(memory[p]["VmRSS"]) if p in memory else "-" for p in MEMORY_PHASES],
                       _mib(res["peak_rss_bytes"][worst]))
        last = memory["last step"]
        state = res["model_state_bytes"][worst].get("total")
        held.add_row(name, _mib(last["VmRSS"]), _mib(last.get("heap_in_use", 0)), _mib(last.get("heap_free", 0)),
                     _mib(last.get("mmapped", 0)), str(last.get("Threads", "-")),
                     _mib(state) if state is not None else "-",
                     _mib(last["VmRSS"] - state) if state is not None else "-")
    console.print(phases)
    console.print(held)
    sampled = Table(title="The peak, sampled every 2 ms (MiB): the phase it fell in, glibc's heap at that moment, "
                          "and each phase's own peak")
    for column in ("engine", "peak", "phase", "heap in use", "heap free, kept", "mmapped apart",
                   "forward", "backward", "step", "outside a step"):
        sampled.add_column(column, justify="left" if column in ("engine", "phase") else "right")
    for name, res in results["engines"].items():
        if "error" in res or not res.get("memory") or not res["memory"][0]:
            continue
        worst = max(range(len(res["peak_rss_bytes"])), key=lambda r: res["peak_rss_bytes"][r])
        found = res["memory"][worst].get("sampled")
        if not found:
            continue
        at = found["at_peak"]
        sampled.add_row(name, _mib(found["peak"]), at.get("phase", "-"), _mib(at.get("in_use", 0)),
                        _mib(at.get("free", 0)), _mib(at.get("mmapped", 0)),
                        *[_mib(found["by_phase"][p]) if p in found["by_phase"] else "-"
                          for p in ("forward", "backward", "step", "outside a step")])
    console.print(sampled)


def ratios(engines: dict[str, Any]) -> dict[str, float]:
    """zero3's (and zero3-persist0's, zero3-lean's) step time and peak memory over every other engine's."""
    out: dict[str, float] = {}
    ckpt, plain = engines.get("zero3-ckpt"), engines.get("zero3")
    if ckpt and plain and "error" not in ckpt and "error" not in plain:
        out["zero3-ckpt/zero3 median step time"] = ckpt["median_ms"] / plain["median_ms"]
    for name in ("zero3", "zero3-persist0", "zero3-lean"):
        res = engines.get(name)
        if not res or "error" in res:
            continue
        for other, base in engines.items():
            if other.startswith("zero3") or "error" in base:
                continue
            out[f"{name}/{other} median step time"] = res["median_ms"] / base["median_ms"]
            out[f"{name}/{other} peak memory"] = res["peak_memory_bytes"] / base["peak_memory_bytes"]
    return out


def print_profile(path: str, console: Any, top: int) -> None:
    buf = io.StringIO()
    stats = pstats.Stats(path, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    console.print(f"[bold]cProfile of zero3 rank 0, timed steps, by own time (top {top}):[/bold]")
    console.print(buf.getvalue(), markup=False, highlight=False)
    buf = io.StringIO()
    stats = pstats.Stats(path, stream=buf)
    stats.sort_stats("cumulative").print_stats("zero3", top)
    console.print(f"[bold]... zero3's own functions by cumulative time (top {top}):[/bold]")
    console.print(buf.getvalue(), markup=False, highlight=False)


# ------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Step-time benchmark: zero3 vs PyTorch FSDP2 (vs DeepSpeed if importable) "
        "on the built-in GPT and corpus, gloo, one thread per rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps before them")
    p.add_argument("--n-layer", type=positive_int, default=4)
    p.add_argument("--n-head", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=256)
    p.add_argument("--block-size", type=positive_int, default=128)
    p.add_argument("--micro-batch", type=positive_int, default=8, help="sequences per rank per step")
    p.add_argument("--nproc", type=positive_int, default=2, help="ranks (world size)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--engines", default=",".join(e for e in ENGINES if e not in ("zero3-overlap", "zero3-lean")),
                   help=f"comma-separated subset of {', '.join(ENGINES)}")
    p.add_argument("--offload-optimizer", choices=["none", "cpu"], default="none",
                   help="ZeRO-Offload for zero3 and DeepSpeed (fsdp2 has no optimizer offload: it is skipped)")
    p.add_argument("--reduce-bucket-size", type=positive_int, default=None,
                   help="zero_optimization.reduce_bucket_size for zero3 and DeepSpeed (default: DeepSpeed's 5e8)")
    p.add_argument("--prefetch-bucket-size", type=non_negative_int, default=None,
                   help="zero_optimization.stage3_prefetch_bucket_size for zero3 and DeepSpeed (default: DeepSpeed's "
                   "5e7, which can gather a small model whole ahead of its use; FSDP2 prefetches one block)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="fp32 on a CPU without bf16 matmul units (bf16 backward is ~30x slower there)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="runs per engine, alternating between engines; figures are medians over runs")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda: one GPU per rank, nccl; auto: cuda when there is a GPU for every rank")
    p.add_argument("--breakdown", action="store_true",
                   help="after the timed rounds, one more run per engine with torch.profiler on rank 0: how a step "
                   "splits into compute, communication, optimizer and the rest (Python: hooks, bookkeeping)")
    p.add_argument("--out", type=Path, default=_DEFAULT_OUT, help="JSON results file")
    p.add_argument("--trace", type=Path, default=None,
                   help="directory: rank 0 of each engine's first run profiles 5 extra steps (CPU and CUDA ops)"
                        " and writes <engine>_trace.txt there")
    p.add_argument("--memory-timeline", type=Path, default=None,
                   help="a directory: the first run of each engine writes each rank's sampled memory timeline "
                        "there (seconds, phase, RSS, glibc's heap in use / free / mmapped; JSON), with --memory's "
                        "tables")
    p.add_argument("--memory", action="store_true",
                   help="also print where each engine's resident memory goes (RSS after each phase; glibc's heap "
                   "in use and kept free, threads, the model state's bytes)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile rank 0 of the 'zero3' run over its timed steps and print the "
                   "hotspots (its timings are then inflated by the profiler)")
    p.add_argument("--profile-top", type=positive_int, default=25)
    return p


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        print(f"unknown engine(s): {', '.join(unknown)}; choose from {', '.join(ENGINES)}", file=sys.stderr)
        return 2

    if args.trace:
        args.trace.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus()
    gpt = GPTConfig(vocab_size=CharTokenizer(corpus).vocab_size, block_size=args.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    tokens_per_step = args.micro_batch * args.nproc * args.block_size
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc else "cpu"
    if device == "cuda" and torch.cuda.device_count() < args.nproc:
        print(f"--device cuda needs a GPU per rank: {torch.cuda.device_count()} GPU(s) for {args.nproc} ranks",
              file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile_path = str(args.out.with_suffix(".zero3-rank0.prof"))

    # One thread per rank (torchrun's choice): N ranks each using every core oversubscribe.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)

    results: dict[str, Any] = {
        "provenance": provenance(),
        "setup": {
            **{k: v for k, v in vars(args).items() if k not in ("out", "engines", "profile_top", "trace", "memory_timeline")},
            "vocab_size": gpt.vocab_size,
            "num_parameters": gpt.num_parameters(),
            "tokens_per_step": tokens_per_step,
            "launcher": "torch.distributed.launcher.api.elastic_launch",
            "device": device,
            "backend": "nccl" if device == "cuda" else "gloo",
            "threads_per_rank": 1,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "zero3_config": ds_config(args.micro_batch, None, args.offload_optimizer, args.precision,
                                      args.reduce_bucket_size, None, args.prefetch_bucket_size),
        },
        "engines": {},
    }
    runnable: list[str] = []
    for name in engines:
        if name == "fsdp2" and args.offload_optimizer != "none":
            console.print("fsdp2: no optimizer offload (its CPUOffloadPolicy moves parameters too); skipped")
            results["engines"][name] = {"error": "no optimizer-only offload"}
            continue
        if name == "ddp" and args.offload_optimizer != "none":
            results["engines"][name] = {"error": "no optimizer offload"}
            continue
        if name == "zero3-overlap" and args.offload_optimizer != "cpu":
            console.print("zero3-overlap: the overlapped host step needs --offload-optimizer cpu; skipped")
            results["engines"][name] = {"error": "needs --offload-optimizer cpu"}
            continue
        if name == "deepspeed":
            try:
                import deepspeed  # noqa: F401
            except Exception as exc:  # ImportError, or a broken install
                msg = f"not importable ({type(exc).__name__}: {exc})"
                console.print(f"deepspeed: {msg}; skipped")
                results["engines"][name] = {"error": msg}
                continue
        runnable.append(name)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runnable}
    failures: dict[str, list[str]] = {name: [] for name in runnable}
    for round_index in range(args.rounds):
        shift = round_index % max(len(runnable), 1)
        for name in runnable[shift:] + runnable[:shift]:  # rotated, so no engine always runs first
            if failures[name] and not runs[name]:
                continue  # it never ran: it will not now
            job = Job(engine=name, model=gpt, micro_batch=args.micro_batch, steps=args.steps,
                      warmup=args.warmup, seed=args.seed,
                      profile=args.profile and name == "zero3" and round_index == 0, profile_out=profile_path,
                      offload_optimizer=args.offload_optimizer, precision=args.precision,
                      reduce_bucket_size=args.reduce_bucket_size, prefetch_bucket_size=args.prefetch_bucket_size,
                      device=device, trace_out=str(args.trace / f"{name}_trace.txt") if args.trace and round_index == 0 else "",
                      memory=args.memory or bool(args.memory_timeline),
                      memory_timeline=str(args.memory_timeline) if args.memory_timeline and round_index == 0 else "")
            console.print(f"round {round_index + 1}/{args.rounds}: running {name} ...")
            t0 = time.perf_counter()
            try:
                per_rank = launch(job, args.nproc)
            except Exception as exc:
                msg = exc.format_msg() if hasattr(exc, "format_msg") else f"{type(exc).__name__}: {exc}"
                console.print(f"[red]{name} failed[/red]:\n{msg}", markup=True, highlight=False)
                failures[name].append(f"failed: {str(exc).splitlines()[0][:200]}")
                continue
            run = summarize(per_rank, tokens_per_step)
            run["launch_wall_s"] = time.perf_counter() - t0
            runs[name].append(run)
    for name in runnable:
        # The runs that finished count (a later one killed, say, by a time limit, leaves them standing).
        results["engines"][name] = combine(runs[name]) if runs[name] else {"error": failures[name][0]}
        if runs[name] and failures[name]:
            results["engines"][name]["failed_runs"] = failures[name]
    results["ratios"] = ratios(results["engines"])
    # Written now, and again after the profiled runs: a run cut short there keeps the timings.
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    if args.breakdown:
        print_report(results, console)  # one more run each, profiled, kept out of the timings (the profiler slows a step)
        for name in runnable:
            if "error" in results["engines"][name]:
                continue
            job = Job(engine=name, model=gpt, micro_batch=args.micro_batch, steps=args.steps, warmup=args.warmup,
                      seed=args.seed, offload_optimizer=args.offload_optimizer, precision=args.precision,
                      reduce_bucket_size=args.reduce_bucket_size, prefetch_bucket_size=args.prefetch_bucket_size,
                      device=device, breakdown=True)
            console.print(f"profiling {name} ...")
            try:
                results["engines"][name]["breakdown"] = summarize(launch(job, args.nproc), tokens_per_step)["breakdown"]
            except Exception as exc:
                console.print(f"[red]profiling {name} failed[/red]: {str(exc).splitlines()[0][:200]}", markup=True)

    print_report(results, console)
    if args.memory or args.memory_timeline:
        print_memory(results, console)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    console.print(f"results written to {args.out}")
    if args.profile and "zero3" in engines and Path(profile_path).exists():
        print_profile(profile_path, console, args.profile_top)
        console.print(f"profile written to {profile_path} (python -m pstats {profile_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
