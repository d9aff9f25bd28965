#!/usr/bin/env python
"""By-hand benchmark: Hugging Face's Trainer on zero3 (`Zero3Trainer`) against the same Trainer on plain
PyTorch (DDP through accelerate), on FSDP2 and on DeepSpeed ZeRO-3
(`TrainingArguments(deepspeed=...)`, only where `import deepspeed` works).

Not a test: nothing asserts on timings. Each engine trains the same small `LlamaForCausalLM` (built from a
config, nothing downloaded; the same seed) on the same random tokens, fp32, AdamW, clipping 1.0, in its
own freshly launched processes (`torchrun`, gloo on the CPU, one thread per rank), so each engine's peak
RSS is its own. A callback times each optimizer step (wall clock between the Trainer's step begin and
end); the first steps are warm-up. `--rounds N` alternates the engines N times (order rotated each
round); an engine's figure is the median over its runs of each run's median step. Prints a table and
zero3's ratio to each other engine, and writes JSON to `--out`.

    python benchmarks/hf_trainer.py                              # about 2 minutes on 2 cores
    python benchmarks/hf_trainer.py --rounds 3 --hidden 512 --layers 6
    python benchmarks/hf_trainer.py --rounds 1 --engines zero3,ddp --profile   # where each step's time goes

The "params held" column is the share of the model's parameter elements a rank holds after training
(1.00 unsharded, about 1/world sharded): it shows each engine really shards.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENGINES = ("zero3", "ddp", "fsdp2", "deepspeed")


def worker(options: argparse.Namespace) -> None:
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=options.vocab, hidden_size=options.hidden, intermediate_size=4 * options.hidden,
        num_hidden_layers=options.layers, num_attention_heads=max(1, options.hidden // 64),
        num_key_value_heads=max(1, options.hidden // 64), max_position_embeddings=options.seq_len,
    ))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows = torch.randint(0, options.vocab, (options.steps * options.micro_batch * world, options.seq_len),
                         generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row.clone()} for row in rows]
    zero3_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                    "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}
    extra: dict[str, Any] = {}
    on_gpu = torch.cuda.is_available()
    if options.engine == "fsdp2" and on_gpu:
        extra = {"fsdp": "full_shard auto_wrap",
                 "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    elif options.engine == "fsdp2":
        # Accelerate has no FSDP on the CPU (it runs DDP there whatever `fsdp_config` says: measured, every
        # rank held the whole model), so FSDP2 is applied by hand, as accelerate would: each decoder layer,
        # then the root. The Trainer then leaves the model unwrapped (below).
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif options.engine == "deepspeed":
        extra = {"deepspeed": {**zero3_config, "optimizer": {"type": "AdamW", "params": {
            "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}}}
    args = transformers.TrainingArguments(
        output_dir=options.scratch, per_device_train_batch_size=options.micro_batch, max_steps=options.steps,
        learning_rate=1e-3, max_grad_norm=1.0, logging_steps=options.steps, save_strategy="no", report_to=[],
        seed=0, use_cpu=not on_gpu, disable_tqdm=True, **extra,
    )
    step_times: list[float] = []
    rank = int(os.environ.get("RANK", "0"))
    # --profile: cProfile on rank 0 over the steps after warm-up (inflates them; the timed figures of a
    # profiled run are not comparable with an unprofiled one's).
    profiler = cProfile.Profile() if options.profile and rank == 0 else None

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if profiler is not None and len(step_times) >= options.warmup:
                profiler.enable()
            self.started = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_times.append(time.perf_counter() - self.started)
            if profiler is not None:
                profiler.disable()

    if options.engine == "zero3":
        from zero3.integrations.hf import Zero3Trainer

        trainer = Zero3Trainer(model=model, args=args, train_dataset=data, zero3_config=zero3_config,
                               callbacks=[StepTimer()])
    elif options.engine == "fsdp2" and not on_gpu:

        class Unwrapped(torch.nn.Module):
            """Handed back by `_wrap_model`: the Trainer then prepares only the optimizer (no DDP around the
            FSDP2 model, which reduces its own gradients)."""

            def __init__(self, module: torch.nn.Module) -> None:
                super().__init__()
                self.module = module

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return self.module(*args, **kwargs)

        class FSDP2Trainer(transformers.Trainer):
            def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
                return Unwrapped(model) if training else model

        trainer = FSDP2Trainer(model=model, args=args, train_dataset=data, callbacks=[StepTimer()])
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[StepTimer()])
    trainer.train()
    if profiler is not None:
        profiler.dump_stats(f"{options.result}.prof")
    Path(options.result).with_suffix(f".rank{rank}.json").write_text(json.dumps({
        "step_times": step_times, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "held_fraction": held_fraction(model),
        "loss": [h["train_loss"] for h in trainer.state.log_history if "train_loss" in h],
    }))


def held_fraction(model: Any) -> float:
    """The share of the model's parameter elements this rank holds after training: 1.0 unsharded (DDP),
    about 1/world sharded. It shows that an engine really shards, rather than taking its word for it."""
    from torch.distributed.tensor import DTensor

    from zero3.partition.sharded_param import sharded

    held = full = 0
    for param in model.parameters():
        sp = sharded(param)
        if sp is not None:  # zero3: the shard's elements, of the parameter's
            held, full = held + sp.shard_numel, full + sp.numel
        elif isinstance(param, DTensor):  # FSDP2
            held, full = held + param.to_local().numel(), full + param.numel()
        elif hasattr(param, "ds_numel"):  # DeepSpeed ZeRO-3
            held, full = held + param.ds_tensor.numel(), full + param.ds_numel
        else:
            held, full = held + param.numel(), full + param.numel()
    return held / full


def launch(engine: str, options: argparse.Namespace, scratch: str) -> dict[str, Any] | None:
    result = Path(scratch) / f"{engine}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(options.world),
               __file__, "--worker", "--engine", engine, "--result", str(result), "--scratch", scratch,
               *[f"--{key.replace('_', '-')}={getattr(options, key)}" for key in
                 ("steps", "warmup", "micro_batch", "seq_len", "hidden", "layers", "vocab")],
               *(["--profile"] if options.profile else [])]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        print(f"{engine}: failed\n{done.stderr[-2000:]}")
        return None
    ranks = [json.loads(Path(f"{result}.rank{r}.json").read_text()) for r in range(options.world)]
    timed = [max(per_rank) for per_rank in zip(*(r["step_times"] for r in ranks))][options.warmup:]
    outcome = {"step": statistics.median(timed), "peak_rss": max(r["peak_rss"] for r in ranks),
               "loss": ranks[0]["loss"], "held_fraction": max(r["held_fraction"] for r in ranks)}
    if options.profile:
        outcome["profile"] = profile_summary(f"{result}.prof", options.steps - options.warmup, options.profile_top)
    return outcome


# Where a function's own time (cProfile's tottime) is counted: by the file it lives in. C functions
# (torch's kernels, called from Python; autograd's backward, whose Python hooks are counted apart) are
# "C calls".
PACKAGES = ("zero3", "transformers", "accelerate", "deepspeed", "torch")


def _package(filename: str) -> str:
    if filename == "~":
        return "C calls"
    for package in PACKAGES:
        if f"/{package}/" in filename:
            return package
    return "other Python"


def profile_summary(path: str, steps: int, top: int) -> dict[str, Any]:
    """Rank 0's profiled steps: own time per package and the top functions by own time, in ms per step."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    by_package: dict[str, float] = {}
    functions = []
    for (filename, line, name), (_, calls, tottime, _, _) in stats.items():
        package = _package(filename)
        by_package[package] = by_package.get(package, 0.0) + tottime
        where = name if filename == "~" else f"{Path(filename).name}:{line} {name}"
        functions.append((tottime, calls, where))
    functions.sort(reverse=True)
    return {"ms_per_step_by_package": {k: 1000 * v / steps for k, v in sorted(by_package.items(), key=lambda kv: -kv[1])},
            "top": [{"function": where, "ms_per_step": 1000 * tottime / steps, "calls_per_step": calls / steps}
                    for tottime, calls, where in functions[:top]]}


def _device_label() -> str:
    import torch

    return f"CUDA, nccl: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "CPU, gloo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--out", default="hf_trainer.json")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile rank 0 of each engine's runs: own time per package and the top functions")
    parser.add_argument("--profile-top", type=int, default=15)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options)
        return
    engines = [e for e in options.engines.split(",") if e != "deepspeed" or importlib.util.find_spec("deepspeed")]
    if "deepspeed" in options.engines.split(",") and "deepspeed" not in engines:
        print("deepspeed: not importable here, left out")
    runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(options.rounds):
            order = engines[round_index % len(engines):] + engines[: round_index % len(engines)]
            for engine in order:
                outcome = launch(engine, options, scratch)
                if outcome is not None:
                    runs[engine].append(outcome)
    table = {engine: {"step_s": statistics.median(r["step"] for r in results),
                      "peak_rss_mib": statistics.median(r["peak_rss"] for r in results) / 2**20,
                      "train_loss": results[-1]["loss"], "held_fraction": results[-1]["held_fraction"],
                      "runs": len(results)}
             for engine, results in runs.items() if results}
    print(f"\nHugging Face Trainer, Llama hidden {options.hidden} x {options.layers} layers, seq {options.seq_len}, "
          f"micro-batch {options.micro_batch}, world {options.world} ({_device_label()}), median of {options.rounds} rounds")
    print(f"{'engine':10} {'s/step':>8} {'peak RSS MiB':>13} {'params held':>12} {'zero3 time ratio':>17} "
          f"{'zero3 RSS ratio':>16}")
    base = table.get("zero3")
    for engine, row in table.items():
        ratio = f"{base['step_s'] / row['step_s']:.2f}x" if base else "-"
        rss_ratio = f"{base['peak_rss_mib'] / row['peak_rss_mib']:.2f}x" if base else "-"
        print(f"{engine:10} {row['step_s']:8.3f} {row['peak_rss_mib']:13.0f} {row['held_fraction']:12.2f} "
              f"{ratio:>17} {rss_ratio:>16}")
    if options.profile:
        for engine, results in runs.items():
            if not results:
                continue
            summary = results[-1]["profile"]
            table[engine]["profile"] = summary
            packages = ", ".join(f"{k} {v:.1f}" for k, v in summary["ms_per_step_by_package"].items())
            print(f"\n{engine}, rank 0, ms per profiled step by package (own time): {packages}")
            for row in summary["top"]:
                print(f"  {row['ms_per_step']:8.2f} ms {row['calls_per_step']:8.0f} calls  {row['function']}")
    Path(options.out).write_text(json.dumps({"options": vars(options), "engines": table}, indent=2))
    print(f"\nJSON: {options.out}")


if __name__ == "__main__":
    main()
