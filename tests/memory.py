"""Peak memory of a call: on the CPU from the profiler's record of every allocation (not RSS: glibc keeps
freed memory, per thread arena, in a way that varies run to run); on a GPU from the caching allocator's
own peak."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def peak_extra_device_bytes(run: Any, device: torch.device) -> dict[str, int]:
    """Peak device bytes allocated (net) while `run()` runs, from the CUDA caching allocator's peak. NCCL
    writes a gather in place (no staging of its own), so "all" and "engine" are the same figure."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    return {"all": peak, "engine": peak}


def peak_extra_bytes(run: Any) -> dict[str, int]:
    """Peak bytes allocated (net) while `run()` runs, from the profiler's record of CPU allocations.

    "all": the allocator's own running total, every thread. "engine": what the calling thread
    allocates outside the collectives' calls, so without gloo's staging (c10d and gloo each stage a
    whole all-gather output in a buffer of their own, inside the call and on gloo's worker threads;
    NCCL on a GPU writes in place). A block the calling thread made counts until it is freed, on
    whichever thread that happens (a collective's worker thread may drop the last reference to a
    tensor it was handed).
    """
    caller = threading.get_native_id()
    with tempfile.TemporaryDirectory() as scratch:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        path = os.path.join(scratch, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
             if e.get("ph") == "X" and e.get("tid") == caller and str(e.get("name", "")).startswith("c10d::")]
    memory = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                    key=lambda e: e["ts"])
    if not memory:
        return {"all": 0, "engine": 0}
    before = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    counted: dict[int, int] = {}
    engine = engine_peak = 0
    for e in memory:
        nbytes, addr, ts = e["args"]["Bytes"], e["args"]["Addr"], e["ts"]
        if nbytes > 0:
            if e["tid"] != caller:
                continue
            if any(start <= ts <= end for start, end in spans):
                continue  # the collective's own staging
            counted[addr] = nbytes
            engine += nbytes
            engine_peak = max(engine_peak, engine)
        else:
            engine -= counted.pop(addr, 0)
    return {"all": max(e["args"]["Total Allocated"] for e in memory) - before, "engine": engine_peak}
