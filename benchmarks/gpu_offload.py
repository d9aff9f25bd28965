#!/usr/bin/env python
"""By-hand: `offload_states` / `reload_states` of a GPT on one CUDA device (world of one).

Builds the built-in GPT under `zero3.Init` on `cuda:0`, trains `--steps` steps (bf16, AdamW),
then times `--cycles` blocking offload/reload cycles of every state to host memory. The first
offload allocates the pinned host pool; later ones reuse it, so they run at the PCIe limit.
Prints a table (seconds, GB/s, device memory before/after) and writes JSON at `--out`.

    python benchmarks/gpu_offload.py --n-layer 20 --n-embd 2304 --n-head 18
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \
        python benchmarks/gpu_offload.py ...          # pinned pages registered instead of allocated
    python benchmarks/gpu_offload.py --pin-ahead      # engine.pin_offload_buffers() right after
                                                      # initialize, while the --steps train
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zero3
from zero3.cli import positive_int
from zero3.data import CharTokenizer, load_corpus, sample_global_batch
from zero3.models.gpt import GPT, GPTConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=positive_int, default=20)
    p.add_argument("--n-embd", type=positive_int, default=2304)
    p.add_argument("--n-head", type=positive_int, default=18)
    p.add_argument("--block-size", type=positive_int, default=1024)
    p.add_argument("--micro-batch", type=positive_int, default=8)
    p.add_argument("--steps", type=positive_int, default=2)
    p.add_argument("--cycles", type=positive_int, default=3)
    p.add_argument("--pin-ahead", action="store_true",
                   help="engine.pin_offload_buffers() after initialize; the steps train while it pins")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_offload.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_offload.py needs a CUDA device")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    text = load_corpus()
    tokenizer = CharTokenizer(text)
    tokens = tokenizer.encode(text)
    shape = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                      n_head=args.n_head, n_embd=args.n_embd)
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
    }
    torch.manual_seed(0)
    with zero3.Init(config=cfg, device=device):
        model = GPT(shape)
    engine, _, _, _ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg, device=device)
    generator = torch.Generator()
    pin_started = time.perf_counter()
    pinning = engine.pin_offload_buffers() if args.pin_ahead else 0
    step_s = []
    for step in range(args.steps):
        generator.manual_seed(step)
        x, y = sample_global_batch(tokens, args.block_size, args.micro_batch, generator)
        t0 = time.perf_counter()
        out = engine(x.to(device), y.to(device))
        engine.backward(out["loss"])
        engine.step()
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
    pinned_within_steps = not engine.parts.host_pool.reserving
    engine.parts.host_pool.settle()
    pin_s = time.perf_counter() - pin_started if args.pin_ahead else None
    torch.cuda.synchronize()
    state_bytes = sum(sum(places.values()) for places in engine.state_report().values())
    rows = []
    for cycle in range(args.cycles):
        before = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        engine.offload_states(device="cpu")
        torch.cuda.synchronize()
        offload_s = time.perf_counter() - t0
        after = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        engine.reload_states()
        torch.cuda.synchronize()
        reload_s = time.perf_counter() - t0
        rows.append({"cycle": cycle, "offload_s": offload_s, "reload_s": reload_s,
                     "device_bytes_before": before, "device_bytes_after": after})
    params = shape.num_parameters()
    print(f"GPT {args.n_layer} x {args.n_embd}: {params / 1e6:.1f}M params, {state_bytes / 2**30:.2f} GiB of state;"
          f" PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    if args.pin_ahead:
        print(f"pin_offload_buffers: {pinning} buffers pinned {pin_s:.2f} s after the call"
              f" ({'within' if pinned_within_steps else 'after'} the {args.steps} steps);"
              f" step s: {', '.join(f'{s:.3f}' for s in step_s)}")
    host_stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    print("pinned host MiB (pool / torch's host allocator):", f"{engine.parts.host_pool.pinned_bytes / 2**20:,.0f}",
          "/", f"{host_stats.get('allocated_bytes.current', host_stats.get('allocated_bytes', 0)) / 2**20:,.0f}"
          if host_stats else "n/a")
    print("| cycle | offload s | GB/s | reload s | GB/s | device MiB before | after |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['cycle']} | {r['offload_s']:.3f} | {state_bytes / r['offload_s'] / 1e9:.2f} | {r['reload_s']:.3f} |"
              f" {state_bytes / r['reload_s'] / 1e9:.2f} | {r['device_bytes_before'] / 2**20:,.1f} |"
              f" {r['device_bytes_after'] / 2**20:,.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from provenance import provenance  # benchmarks/provenance.py, beside this script

    args.out.write_text(json.dumps({"benchmark": "gpu_offload", "provenance": provenance(), "params": params,
                                    "state_bytes": state_bytes, "rows": rows,
                                    "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                                    "pin_ahead": args.pin_ahead, "pin_s": pin_s,
                                    "pinned_within_steps": pinned_within_steps, "step_s": step_s,
                                    "host_memory_stats": {k: v for k, v in host_stats.items()
                                                          if "bytes" in k and "current" in k or "peak" in k}},
                                   indent=2, default=str))
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
