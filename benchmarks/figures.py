#!/usr/bin/env python
"""Writes the figure tables of docs/benchmarks.md and the README's headline table from benchmark JSON.

The JSON of every published run lives in `benchmarks/measured/` (a benchmark's `--out`/`--json` file,
copied there when it is the run to quote; each carries its `provenance`: date, command, machine). Each
file has a section in docs/benchmarks.md between `<!-- figures: begin NAME -->` and
`<!-- figures: end NAME -->` (NAME: the file's stem), and the README's headline table sits between the
same markers named `headline`. A rerun refreshes the pages, never a hand edit:

    cp /tmp/step.json benchmarks/measured/step_time_cpu_6x512_bf16.json
    python benchmarks/figures.py            # rewrite the tables (and --plots: the PNGs, needs matplotlib)
    python benchmarks/figures.py --check    # exit 1 if a page is not what the JSON says (the test suite runs it)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks" / "measured"
BENCHMARKS_PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
MIB = 2**20

Figures = dict[str, dict[str, Any]]


def load_measured(folder: Path = MEASURED) -> Figures:
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}


def day(run: dict[str, Any]) -> str:
    return str(run["provenance"]["date"])[:10]


def provenance_line(run: dict[str, Any]) -> str:
    made = run["provenance"]
    return f"Measured {day(run)} on {made['machine']}, torch {made['torch']}:\n`{made['command']}`"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---- step_time.py ---------------------------------------------------------------------------------------

def step_setup(run: dict[str, Any]) -> str:
    setup = run["setup"]
    offload = "" if setup.get("offload_optimizer", "none") == "none" else f", optimizer offload {setup['offload_optimizer']}"
    return (f"GPT, {setup['num_parameters'] / 1e6:,.1f}M parameters ({setup['n_layer']} layers x {setup['n_embd']}, "
            f"sequence {setup['block_size']}), micro batch {setup['micro_batch']} x {setup['nproc']} rank(s), "
            f"{setup['device']}, {setup['precision']}{offload}; {setup['steps']} timed steps after {setup['warmup']}, "
            f"{setup['rounds']} alternated run(s) per engine")


def step_engines(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: figures for name, figures in run["engines"].items() if "median_ms" in figures}


def memory_label(run: dict[str, Any]) -> str:
    return "peak device MiB (max allocated)" if run["setup"]["device"] == "cuda" else "peak RSS MiB (largest rank)"


def render_step_time(run: dict[str, Any]) -> str:
    engines = step_engines(run)
    zero3 = engines.get("zero3")
    rows = []
    for name, figures in engines.items():
        runs = ", ".join(f"{value:,.1f}" for value in figures.get("run_medians_ms", [figures["median_ms"]]))
        ratio = f"{zero3['median_ms'] / figures['median_ms']:.2f}" if zero3 and name != "zero3" else ""
        peak = figures.get("peak_memory_bytes")
        memory_ratio = (f"{zero3['peak_memory_bytes'] / peak:.2f}"
                        if zero3 and name != "zero3" and peak and zero3.get("peak_memory_bytes") else "")
        rows.append([f"`{name}`", f"**{figures['median_ms']:,.1f}**", runs,
                     f"{peak / MIB:,.0f}" if peak else "", ratio, memory_ratio])
    failed = [f"{name}: {figures['error']}" for name, figures in run["engines"].items() if "error" in figures]
    stopped = [f"{name} ({len(figures['failed_runs'])}: {', '.join(figures['failed_runs'])})"
               for name, figures in engines.items() if figures.get("failed_runs")]
    text = (f"{step_setup(run)}.\n\n" + table(["engine", "median step ms", "run medians ms", memory_label(run),
                                                "zero3 / this, time", "zero3 / this, memory"], rows))
    if failed:
        text += "\n\nNot measured: " + "; ".join(failed) + "."
    if stopped:
        text += "\n\nRuns that did not finish, left out of the figures: " + "; ".join(stopped) + "."
    return text + "\n\n" + provenance_line(run)


def step_ratio(run: dict[str, Any], engine: str, other: str, what: str = "median_ms") -> float:
    engines = run["engines"]
    key = "median_ms" if what == "median_ms" else "peak_memory_bytes"
    return float(engines[engine][key]) / float(engines[other][key])


# ---- checkpoint.py ----------------------------------------------------------------------------------------

def render_checkpoint(run: dict[str, Any]) -> str:
    rows = []
    plain = {kind: statistics.median(run["rows"][f"plain {kind}"]) for kind in ("save", "load")}
    for name, times in run["rows"].items():
        median = statistics.median(times)
        engine = "zero3" if name.startswith("zero3") else "plain" if name.startswith("plain") else "fsdp2"
        kind = "load" if name.endswith("load") else "save"
        rate = run["bytes"][engine] / median / 1e9
        blocked = name.endswith("(blocked)")  # the caller's wait, not a transfer: no rate, no ratio
        rows.append([name, f"**{median:.3f}**", ", ".join(f"{t:.3f}" for t in times),
                     "" if blocked else f"{rate:.2f}", "" if blocked else f"{plain[kind] / median:.2f}"])
    ratio = run["load_time_ratio"]["of_medians"]
    return (f"Two ranks (gloo), {run['parameters'] / 1e6:,.1f}M parameters of fp32 GPT with AdamW "
            f"({run['bytes']['zero3'] / MIB:,.0f} MiB on disk); the page cache dropped before each load; "
            f"a time is the slowest rank's.\n\n"
            + table(["what", "median s", "repeats s", "GB/s", "plain / this"], rows)
            + f"\n\nzero3's load against plain `torch.load` of the same bytes: **{ratio:.2f}x** "
              f"(plain's time / zero3's; issue 39's goal: at least 0.8).\n\n" + provenance_line(run))


# ---- recovery.py ------------------------------------------------------------------------------------------

def render_recovery(run: dict[str, Any]) -> str:
    engines = list(run["medians"])
    phases = list(run["medians"][engines[0]])
    rows = [[phase, *[f"{run['medians'][engine].get(phase, float('nan')):.2f}" for engine in engines]]
            for phase in phases]
    text = (f"A job of {run['parameters'] / 1e6:,.1f}M parameters on 2 ranks under `torchrun --max-restarts`, one "
            f"rank killed after a checkpoint; seconds from the kill to the first step after the restart, by phase "
            f"(medians).\n\n" + table(["phase, s", *[f"`{engine}`" for engine in engines]], rows))
    if "zero3_over_deepspeed" in run:
        text += f"\n\nzero3 / DeepSpeed, kill to first step: **{run['zero3_over_deepspeed']:.2f}x**."
    return text + "\n\n" + provenance_line(run)


# ---- comm_volume.py -----------------------------------------------------------------------------------------

def render_comm_volume(run: dict[str, Any]) -> str:
    setup = run["setup"]
    rows = []
    for name, row in run["variants"].items():
        small, big = row["measured_2x2"], row["computed_8x8"]
        rows.append([name, f"{small['inside_bytes'] / MIB:.2f}", f"{small['across_bytes'] / MIB:.2f}",
                     f"{big['inside_bytes'] / MIB:.2f}", f"{big['across_bytes'] / MIB:.2f}",
                     f"**{row['across_8x8_in_M']:.2f}M**", f"{row['across_8x8_vs_plain']:.2f}",
                     f"{row['median_step_ms']:,.1f}"])
    plain = run["variants"]["plain ZeRO-3"]
    paper = ", ".join(f"{name} {value}M" for name, value in run["paper_cross_node_M"].items())
    return (f"Bytes each rank sends per step, counted at the engine's collectives: 4 ranks as 2 simulated nodes "
            f"of 2, bf16 GPT {setup['n_layer']} x {setup['n_embd']} (M = {plain['model_16bit_bytes'] / MIB:.1f} MiB "
            f"of 16-bit weights), {setup['steps']} steps; the same collectives re-laid on 8 nodes of 8.\n\n"
            + table(["variant", "2x2 inside MiB", "2x2 across MiB", "8x8 inside MiB", "8x8 across MiB",
                     "8x8 across", "across / plain", "2x2 step ms"], rows)
            + f"\n\nThe ZeRO++ paper's cross-node volume per step: {paper}.\n\n" + provenance_line(run))


# ---- moe.py ------------------------------------------------------------------------------------------------

def render_moe(run: dict[str, Any]) -> str:
    setup, model = run["setup"], run["model"]
    total = model["dense_params"] + model["expert_params"]
    rows = []
    for row in run["variants"].values():
        if "error" in row:
            rows.append([row["variant"], str(row["world"]), f"did not run: {row['error']}", "", "", "", ""])
            continue
        expected = row["expected"]
        rows.append([row["variant"], str(row["world"]), f"{row['median_step_s'] * 1000:,.1f}",
                     f"{row['tokens_per_s']:,.0f}", f"**{row['tokens_per_s_vs_plain']:.2f}**",
                     f"{row['gathered'] / MIB:.2f} ({expected['gathered'] / MIB:.2f})",
                     f"{row['all_to_all'] / MIB:.2f} ({expected['all_to_all'] / MIB:.2f})"])
    computed = run["computed_qwen3_30b_a3b_8x8"]
    plain = computed["autoep_size 1"]["gathered"]
    big = "; ".join(f"{name}: gathered {figures['gathered'] / 2**30:.2f} GiB ({figures['gathered'] / plain:.3f} of "
                    f"plain), all-to-all {figures['all_to_all'] / 2**30:.2f} GiB" for name, figures in computed.items())
    versions = ", ".join(f"{name} {version}" for name, version in run["versions"].items() if version)
    return (f"A Hugging Face Qwen3-MoE from a config: {setup['layers']} layers of {setup['experts']} experts, "
            f"top-{setup['top_k']}, hidden {setup['hidden']}, {total / 1e6:.2f}M parameters "
            f"({model['expert_params'] / total:.0%} in experts), fp32, {run['tokens_per_rank']} tokens per rank and "
            f"step, the median of {setup['steps']} steps after {setup['warmup']}; expert parallelism at autoep_size = "
            f"the ranks. Bytes per rank and step, counted at torch.distributed's collectives; in brackets, the "
            f"arithmetic that gives the Qwen3-30B-A3B figures (gathers: at most; all-to-all: the hidden states on "
            f"balanced routing, without the routing's counts and indices).\n\n"
            + table(["variant", "ranks", "step ms", "tokens/s", "vs plain", "gathered MiB", "all-to-all MiB"], rows)
            + f"\n\nComputed for Qwen3-30B-A3B at 8 nodes x 8 ranks, bf16, 4096 tokens per rank and step: {big}.\n\n"
            + f"With {versions}.\n\n" + provenance_line(run))


# ---- zeropp_loss.py -------------------------------------------------------------------------------------------

def render_zeropp_loss(run: dict[str, Any]) -> str:
    setup = run["setup"]
    steps, every, window = setup["steps"], setup["every"], min(setup["window"], setup["steps"])
    marks = sorted(set(range(0, steps, every)) | {steps - 1})
    rows = [[name, *(f"{curve[m]:.3f}" for m in marks), f"**{run['final_mean'][name]:.3f}**",
             f"{run['final_vs_plain'][name]:.3f}"] for name, curve in run["curves"].items()]
    return (f"Loss of the built-in GPT ({setup['n_layer']} x {setup['n_embd']}, bf16) on the built-in corpus, 4 ranks "
            f"as 2 simulated nodes of 2, the same global batches ({setup['micro_batch']} rows a rank) in every "
            f"variant, AdamW at {setup['lr']}; the last column is the mean of the last {window} steps over plain "
            f"ZeRO-3's.\n\n"
            + table(["variant", *(f"step {m + 1}" for m in marks), f"last {window}", "vs plain"], rows)
            + "\n\n![loss curves](plots/zeropp_loss_cpu.png)\n\n" + provenance_line(run))


# ---- examples/rlhf_colocate.py --------------------------------------------------------------------------------

def rlhf_phases(ranks: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per phase label, over its iterations: median seconds (slowest rank) and the largest rank's RSS after it."""
    phases: dict[str, dict[str, list[float]]] = {}
    for rank in ranks:
        for index, event in enumerate(rank["events"]):
            key = f"{event['label']}#{index}"
            entry = phases.setdefault(key, {"seconds": [], "rss": [], "peak": []})
            entry["seconds"].append(event["seconds"])
            entry["rss"].append(event["rss_end"])
            entry["peak"].append(event["memory_peak"])
    by_label: dict[str, dict[str, list[float]]] = {}
    for key, entry in phases.items():
        label = key.rsplit("#", 1)[0]
        merged = by_label.setdefault(label, {"seconds": [], "rss": [], "peak": []})
        merged["seconds"].append(max(entry["seconds"]))
        merged["rss"].append(max(entry["rss"]))
        merged["peak"].append(max(entry["peak"]))
    return {label: {"n": len(entry["seconds"]), "seconds": statistics.median(entry["seconds"]),
                    "rss": statistics.median(entry["rss"]), "peak": max(entry["peak"])}
            for label, entry in by_label.items()}


def render_rlhf(run: dict[str, Any]) -> str:
    passes = {str(each["park"]): rlhf_phases(each["ranks"]) for each in run["passes"]}
    parked_name = next(name for name in passes if name != "None")
    parked, plain = passes[parked_name], passes.get("None", {})
    rows = []
    for label, figures in parked.items():
        other = plain.get(label)
        rows.append([label, str(figures["n"]), f"{figures['seconds']:.3f}", f"{figures['rss'] / MIB:,.0f}",
                     f"{figures['peak'] / MIB:,.0f}",
                     f"{other['seconds']:.3f}" if other else "", f"{other['peak'] / MIB:,.0f}" if other else ""])
    peak_parked = max(figures["peak"] for figures in parked.values())
    peak_plain = max(figures["peak"] for figures in plain.values()) if plain else float("nan")
    args = run["args"]
    return (f"An actor and a critic (zero3 engines) and a frozen reference, each a GPT of "
            f"{run['num_parameters'] / 1e6:,.1f}M parameters ({args['n_layer']} x {args['n_embd']}), on the same "
            f"{run['world_size']} {run['device']} ranks for {args['iterations']} iterations of generate, score, "
            f"train the actor, train the critic; each engine parked to `{parked_name}` while the others work, "
            f"beside the same loop without parking. Seconds: median over iterations of the slowest rank; memory: "
            f"the largest rank's RSS.\n\n"
            + table(["phase", "n", "s", "RSS after, MiB", "peak, MiB", "no parking: s", "peak, MiB"], rows)
            + f"\n\nPeak RSS over the loop: **{peak_parked / MIB:,.0f} MiB parking, {peak_plain / MIB:,.0f} MiB "
              f"not** ({peak_parked / peak_plain:.2f}x).\n\n" + provenance_line(run))


# ---- weight_sync.py -------------------------------------------------------------------------------------------

def render_weight_sync(run: dict[str, Any]) -> str:
    setup = run["setup"]
    rows = []
    for model, found in run["models"].items():
        medians = found["medians"]
        rows.append([f"GPT {model}", str(found["tensors"]), f"{found['bytes'] / MIB:.1f}", f"{found['bound_s']:.4f}",
                     f"{found['gather_s']:.4f}", f"**{medians['buckets']:.4f}**", f"{found['buckets_over_bound']:.2f}",
                     f"{found['buckets_over_gather_and_copy']:.2f}", f"{medians['per parameter']:.4f}",
                     f"{found['per_parameter_over_buckets']:.2f}",
                     f"{medians['broadcast']:.4f}" if "broadcast" in medians else "", f"{medians['in-process']:.4f}"])
    ranks = setup["nproc"]
    return (f"Every weight from {ranks} training rank{'s' if ranks > 1 else ''} (gloo) to a receiver process over "
            f"shared memory, {setup['precision']}, buckets of {setup['bucket_mib']:g} MiB, medians of "
            f"{setup['repeats']}; copy = the model's bytes over this machine's copy rate, gather = one all-gather of "
            "the whole model on these ranks; per parameter = the same sender with one parameter per bucket; "
            "broadcast = `BroadcastSender` to one generator rank in another process, the same buckets.\n\n"
            + table(["model", "tensors", "MiB", "copy s", "gather s", "buckets s", "x copy", "x gather + copy",
                     "per parameter s", "per parameter / buckets", "broadcast s", "in-process s"], rows)
            + "\n\n" + provenance_line(run))


def render_offload_overlap(run: dict[str, Any]) -> str:
    args = run["args"]
    rows = [[name, f"{figures['backward'] * 1e3:.1f}", f"**{figures['step'] * 1e3:.1f}**", f"{figures['total'] * 1e3:.1f}",
             ", ".join(f"{statistics.median(r['rows']['total']) * 1e3:.0f}" for r in run["runs"][name])]
            for name, figures in run["medians_s"].items()]
    last = run["last_overlapped_step"]
    return (f"GPT {args['n_layer']} x {args['n_embd']} ({run['parameters'] / 1e6:.1f}M parameters), {args['precision']}, "
            f"{args['nproc']} ranks (gloo), `offload_optimizer: cpu`, sub-groups of {int(args['sub_group_size']):,} "
            f"elements; {args['steps']} steps after {args['warmup']}, {args['rounds']} alternated rounds; each phase "
            "the slowest rank's, medians.\n\n"
            + table(["host step", "backward ms", "step ms", "whole step ms", "runs (whole step ms)"], rows)
            + f"\n\nRank 0's last overlapped step: {last['early']} of {last['sub_groups']} sub-groups stepped early, "
            f"{last['begun_inside']} begun before its backward's computation ended ({last['backward_s'] * 1e3:.0f} ms), "
            f"{last['inside_s'] * 1e3:.0f} ms of host step inside it; over the run {last['kept']} sub-group steps "
            f"kept, {last['undone']} undone"
            + (f", {last['skipped']} backwards speculated nothing (the step before was clipped)" if last.get("skipped") else "")
            + ".\n\n" + provenance_line(run))


# ---- gpu_offload.py ------------------------------------------------------------------------------------------

def render_gpu_offload(run: dict[str, Any]) -> str:
    """The first offload of a large model with its pinned buffers made ahead, while training goes on."""
    steps, pin_s = run["step_s"], run["pin_s"]
    rows = [[str(r["cycle"]), f"**{r['offload_s']:.3f}**", f"{run['state_bytes'] / r['offload_s'] / 1e9:.1f}",
             f"{r['reload_s']:.3f}", f"{run['state_bytes'] / r['reload_s'] / 1e9:.1f}"] for r in run["rows"]]
    pinned = run["host_memory_stats"].get("allocated_bytes.current", 0)
    how = "registered pages" if "host_register:True" in run["alloc_conf"] else "the allocator's pinned allocation"
    return (f"GPT, {run['params'] / 1e6:,.1f}M parameters, {run['state_bytes'] / 2**30:.2f} GiB of states, world 1, "
            f"bf16; `engine.pin_offload_buffers()` right after `initialize`, with {how} "
            f"(`PYTORCH_CUDA_ALLOC_CONF={run['alloc_conf']!r}`), while {len(steps)} steps train.\n\n"
            f"Pinned {'within' if run['pinned_within_steps'] else 'after'} the steps ({pin_s:.2f} s from the call "
            f"to the steps' end and the buffers settled). Steps: the first {steps[0]:.3f} s, the rest median "
            f"{statistics.median(steps[1:]):.3f} s, longest {max(steps[1:]):.3f} s. Torch's host allocator holds "
            f"{pinned / 2**20:,.0f} MiB of pinned memory for them (each block rounded up to a power of two).\n\n"
            + table(["cycle", "offload_states s", "GB/s", "reload_states s", "GB/s"], rows)
            + "\n\n" + provenance_line(run))


# ---- fault_tolerance.py ---------------------------------------------------------------------------------------

def render_fault_tolerance(run: dict[str, Any]) -> str:
    setup, kill = run["setup"], run["kill"]
    steps = run["median_step_s"]
    rows = [[layout, f"**{statistics.median(values) * 1e3:,.0f}**", ", ".join(f"{value * 1e3:,.0f}" for value in values)]
            for layout, values in (("HSDP, one job of 4 ranks (`mics_shard_size: 2`)", steps["hsdp"]),
                                   ("torchft, 2 replica groups of 2 ranks", steps["ft"]))]
    phases = [[phase, f"{seconds:.2f}"] for phase, seconds in kill["rejoin_phases_s"].items()]
    phases.append(["**kill -> first step of the rejoined group**", f"**{kill['kill_to_first_step_s']:.2f}**"])
    reference = run.get("restart_reference")
    if reference is not None:
        phases.append(["whole-job restart from the last checkpoint (`benchmarks/recovery.py`, same size, 2 ranks)",
                       f"{reference['kill_to_first_step_s']:.2f}"])
    return (f"GPT {setup['n_layer']} x {setup['n_embd']}, {setup['precision']}, 2 replicas x 2 shards on 4 CPU ranks "
            f"(gloo), each replica on data of its own; torchft {run['torchft']}, lighthouse heartbeat timeout "
            f"{setup['heartbeat_timeout_ms']} ms; medians of steps both replicas took part in, after {setup['warmup']}, "
            f"{setup['rounds']} alternated runs.\n\n"
            + table(["layout", "median step ms", "runs ms"], rows)
            + f"\n\n(a) torchft's step over HSDP's: **{run['ft_over_hsdp']:.2f}x** (issue 45's goal: at most 1.10x).\n\n"
            f"(b) Group 1 SIGKILLed (every rank) after the backward of step {setup['kill_step']}: the surviving group's "
            f"longest step {kill['survivor_longest_step_s']:.2f} s, **{kill['survivor_longest_over_median']:.2f}x** its "
            f"median {kill['survivor_median_step_s']:.2f} s (goal: at most 2x); it trained {kill['survivor_steps_alone']} "
            f"steps alone and dropped {kill['survivor_dropped']}. Group 1 rejoined at step {kill['rejoined_at_step']}.\n\n"
            "(c) Seconds from the kill:\n\n" + table(["phase", "s"], phases)
            + "\n\n![both groups' losses across the kill and the rejoin](plots/fault_tolerance.png)\n\n"
            + provenance_line(run))


# ---- deepspeed_import.py -------------------------------------------------------------------------------

def render_deepspeed_import(run: dict[str, Any]) -> str:
    medians, runs = run["medians"], run["runs"]
    names = {"deepspeed_load_s": "DeepSpeed's own `load_checkpoint`, 2 ranks", "zero3_save_s":
             "one zero3 `save_checkpoint`, 2 ranks", "import_s": "`zero3 import-deepspeed`, one process"}
    rows = [[label, f"**{medians[key]:.3f}**", ", ".join(f"{t:.3f}" for t in runs[key])] for key, label in names.items()]
    return (f"The 6 x 512 GPT ({run['params'] / 1e6:,.1f}M parameters, fp32 masters and Adam), a DeepSpeed 0.19.8 "
            "ZeRO-3 checkpoint saved by 2 ranks; a time is the slowest rank's.\n\n"
            + table(["what", "median s", "repeats s"], rows)
            + f"\n\nThe import over DeepSpeed's load plus one zero3 save: **{run['ratio_to_goal']:.2f}x** "
              "(goal: at most 1.00x).\n\n" + provenance_line(run))


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {"step_time": render_step_time,
                                                          "deepspeed_import": render_deepspeed_import,
                                                          "fault_tolerance": render_fault_tolerance,
                                                          "offload_overlap": render_offload_overlap,
                                                          "checkpoint": render_checkpoint,
                                                          "recovery": render_recovery, "rlhf": render_rlhf,
                                                          "comm_volume": render_comm_volume,
                                                          "moe": render_moe,
                                                          "zeropp_loss": render_zeropp_loss,
                                                          "weight_sync": render_weight_sync,
                                                          "gpu_offload": render_gpu_offload}


def kind(name: str) -> str:
    for prefix in RENDERERS:
        if name.startswith(prefix):
            return prefix
    raise SystemExit(f"benchmarks/measured/{name}.json: no renderer for it (names start with one of {sorted(RENDERERS)})")


# ---- the README's headline table ---------------------------------------------------------------------------

def headline(measured: Figures) -> str:
    """At most ~10 rows: what a reader asks first. Each links to its section of docs/benchmarks.md."""
    rows: list[list[str]] = []

    def add(what: str, name: str, figure: Callable[[dict[str, Any]], str]) -> None:
        if name in measured:
            run = measured[name]
            rows.append([what, figure(run), f"`{run['provenance']['command']}`",
                         f"{run['provenance']['machine']}, {day(run)}", f"[`{name}`](docs/benchmarks.md#{name})"])

    add("1.27B GPT step, bf16, world 1", "step_time_h200_1_27b",
        lambda run: f"{step_ratio(run, 'zero3', 'ddp'):.2f}x plain PyTorch, {step_ratio(run, 'zero3', 'fsdp2'):.2f}x FSDP2")
    add("1.27B GPT peak device memory", "step_time_h200_1_27b_lean",
        lambda run: f"{step_ratio(run, 'zero3', 'fsdp2', 'memory'):.2f}x FSDP2's; with `lean_memory` "
                    f"{step_ratio(run, 'zero3-lean', 'fsdp2', 'memory'):.2f}x (goal 1.0x)")
    calls = [name for name in ("step_time_h200_113m_call1", "step_time_h200_113m_call2") if name in measured]
    for name in calls:
        add("113M GPT step, bf16, world 1 (host-bound)", name,
            lambda run: f"{step_ratio(run, 'zero3', 'ddp'):.2f}x plain PyTorch (goal 1.15x)")
    for name in sorted(measured):
        if name.startswith("step_time_cpu"):
            run = measured[name]
            others = [engine for engine in ("ddp", "fsdp2", "deepspeed") if engine in step_engines(run)]
            ranks = run["setup"]["nproc"]
            stand_in = " (the 113M step's host work, arithmetic shrunk away)" if "standin" in name else ""
            add(f"{run['setup']['n_layer']} x {run['setup']['n_embd']} GPT step, {run['setup']['precision']}, "
                f"{ranks} CPU rank{'s' if ranks > 1 else ''}{stand_in}", name,
                lambda run, others=others: ", ".join(f"{step_ratio(run, 'zero3', other):.2f}x {other}" for other in others)
                + (f"; peak RSS {step_ratio(run, 'zero3', 'fsdp2', 'memory'):.2f}x fsdp2's" if "fsdp2" in others else ""))
    add("checkpoint every step, async (6 x 512 GPT, 2 ranks)", "step_time_checkpoint_overhead_cpu",
        lambda run: f"{step_ratio(run, 'zero3-ckpt', 'zero3'):.2f}x the step without (goal 1.05x)")
    add("checkpoint load vs plain `torch.load`", "checkpoint_cpu",
        lambda run: f"{run['load_time_ratio']['of_medians']:.2f}x its speed (goal 0.8x)")
    def across(run: dict[str, Any]) -> str:
        names = {"MiCS, a shard group per node": "MiCS", "hpZ, a secondary group per node": "hpZ",
                 "hpZ + qwZ + qgZ (ZeRO++)": "all of ZeRO++"}
        plain = run["variants"]["plain ZeRO-3"]["across_8x8_in_M"]
        return ", ".join(f"{short} {run['variants'][name]['across_8x8_vs_plain']:.2f}x"
                         for name, short in names.items() if name in run["variants"]) + f" of plain ZeRO-3's {plain:.2f}M"

    add("cross-node bytes per step, 8 nodes x 8", "comm_volume_cpu", across)
    add("weights to a generator process, 2 ranks, 292 tensors", "weight_sync_cpu",
        lambda run: f"{run['models']['24x64']['per_parameter_over_buckets']:.1f}x faster than one gather per parameter "
                    f"(goal 5x); 289 MiB in {run['models']['12x1024']['buckets_over_gather_and_copy']:.2f}x one "
                    "all-gather + copy")
    add("torchft replica groups (6 x 512 GPT, 2 x 2 ranks)", "fault_tolerance_cpu",
        lambda run: f"step {run['ft_over_hsdp']:.2f}x HSDP's (goal 1.10x); a killed group back training "
                    f"{run['kill']['kill_to_first_step_s']:.1f} s after the kill, its peer's longest step "
                    f"{run['kill']['survivor_longest_over_median']:.2f}x its median (goal 2x)")
    add("a DeepSpeed ZeRO-3 checkpoint imported (6 x 512 GPT, 2 ranks)", "deepspeed_import_cpu",
        lambda run: f"{run['medians']['import_s']:.2f} s, {run['ratio_to_goal']:.2f}x DeepSpeed's load + one zero3 "
                    "save (goal 1.0x)")
    add("kill to first step after a restart", "recovery_cpu",
        lambda run: f"{run['medians']['zero3']['kill -> first step']:.1f} s, "
                    f"{run['zero3_over_deepspeed']:.2f}x DeepSpeed's")
    return table(["what", "zero3", "command", "machine, date", "run"], rows)


# ---- pages ---------------------------------------------------------------------------------------------------

def replace_section(text: str, name: str, body: str, page: Path) -> str:
    pattern = re.compile(rf"(<!-- figures: begin {re.escape(name)} -->\n).*?(<!-- figures: end {re.escape(name)} -->)",
                         re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{page.relative_to(ROOT)} has no '<!-- figures: begin {name} -->' ... "
                         f"'<!-- figures: end {name} -->' section for benchmarks/measured/{name}.json")
    return pattern.sub(lambda match: match[1] + body + "\n" + match[2], text)


def render_pages(measured: Figures) -> dict[Path, str]:
    page = BENCHMARKS_PAGE.read_text()
    for name, run in measured.items():
        page = replace_section(page, name, RENDERERS[kind(name)](run), BENCHMARKS_PAGE)
    readme = replace_section(README.read_text(), "headline", headline(measured), README)
    return {BENCHMARKS_PAGE: page, README: readme}


def plot(measured: Figures, folder: Path) -> list[Path]:
    """Step time and peak memory per engine, one pair of bar charts per step_time run; a zeropp_loss run's
    loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, run in measured.items():
        if kind(name) == "zeropp_loss":
            figure, axis = plt.subplots(figsize=(7, 3.5))
            for variant, curve in run["curves"].items():
                axis.plot(range(1, len(curve) + 1), curve, label=variant, linewidth=1.2,
                          color="tab:gray" if variant.startswith("plain") else None)
            axis.set_xlabel("step")
            axis.set_ylabel("loss (mean over ranks)")
            axis.legend(fontsize=8)
            figure.suptitle(f"{name}: GPT {run['setup']['n_layer']} x {run['setup']['n_embd']}, bf16, 4 ranks as "
                            f"2 nodes of 2, {day(run)}", fontsize=9)
            written.append(save(figure, folder / f"{name}.png"))
            continue
        if kind(name) != "step_time" or len(step_engines(run)) < 2:
            continue
        engines = step_engines(run)
        figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(8, 3))
        labels = list(engines)
        colors = ["tab:orange" if label.startswith("zero3") else "tab:gray" for label in labels]
        time_axis.bar(labels, [engines[label]["median_ms"] for label in labels], color=colors)
        time_axis.set_ylabel("median step, ms")
        memory_axis.bar(labels, [(engines[label].get("peak_memory_bytes") or 0) / MIB for label in labels], color=colors)
        memory_axis.set_ylabel(memory_label(run).replace(" MiB", ", MiB"))
        figure.suptitle(f"{name}: {run['setup']['num_parameters'] / 1e6:,.0f}M params, {run['setup']['device']}, "
                        f"{run['setup']['precision']}, {day(run)}", fontsize=9)
        written.append(save(figure, folder / f"{name}.png"))
    return written


def save(figure: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page differs from its JSON")
    parser.add_argument("--plots", action="store_true", help="also draw docs/plots/<run>.png (needs matplotlib)")
    args = parser.parse_args(argv)
    measured = load_measured()
    pages = render_pages(measured)
    stale = [page for page, text in pages.items() if page.read_text() != text]
    if args.check:
        for page in stale:
            print(f"{page.relative_to(ROOT)} is not what benchmarks/measured/ says: run python benchmarks/figures.py")
        return 1 if stale else 0
    for page in stale:
        page.write_text(pages[page])
        print(f"rewrote {page.relative_to(ROOT)}")
    if args.plots:
        folder = ROOT / "docs" / "plots"
        folder.mkdir(exist_ok=True)
        for path in plot(measured, folder):
            print(f"drew {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
