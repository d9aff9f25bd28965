"""examples/rlhf_colocate.py: actor, critic and reference engines colocated, each parked while another works.

The script runs end to end with a tiny config, as users run it: `python` (a world of one, the default
park target, which is disk on a CPU machine) and `torchrun --nproc_per_node 2` (`--park nvme
--nvme-path`). From its printed tables and its JSON: every phase has its row; while one engine trains,
the others' states are on disk (state_report and get_state_devices say so) and back in memory after
their reload; each park moves exactly the engine's model state (model_state_bytes' total; every
parameter is partitioned, so nothing stays); the losses are finite and equal to the pass without
parking (parking is bit-exact); the PNG is a PNG. Timings and memory figures are printed, not asserted:
on a tiny model they measure overheads and allocator noise.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.distributed import load_script, script_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "rlhf_colocate.py"
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch", "2", "--prompt-len", "8",
        "--new-tokens", "8", "--iterations", "2", "--rate-repeats", "1", "--device", "cpu"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STATES = ("hp_params", "lp_params", "lp_grads", "optim_states")


def example() -> ModuleType:
    return load_script(SCRIPT, "zero3_example_rlhf_colocate")


def run_script(command: list[str], cwd: Path) -> str:
    env = script_env(str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _where(info: dict, state: str, place: str) -> list[str]:
    """The devices a state's report should name: `place` if it lives there. A trained fp32 engine's masters
    are its shards (hp_params holds no bytes of its own): they are where lp_params is; its gradient shards,
    made on demand at 2 CPU ranks, hold no bytes between steps, yet live there (the report names the place
    with 0 bytes). An engine that does not train has neither."""
    held = sum(info["states"][state].values())
    trains = sum(info["states"]["optim_states"].values()) > 0
    if state == "hp_params" and not held and trains:
        held = sum(info["states"]["lp_params"].values())
    if state == "lp_grads" and trains:
        return [place]
    return [place] if held else []


def check_run(stdout: str, out: Path, world: int, disk_root: Path | None) -> None:
    ex = example()
    document = json.loads((out / ex.JSON_NAME).read_text())
    assert document["world_size"] == world and document["args"]["park"] == "nvme"
    parked, plain = document["passes"]
    assert (parked["park"], plain["park"]) == ("nvme", None)
    assert len(parked["ranks"]) == len(plain["ranks"]) == world

    # Every phase has its row in the printed table (rank 0), and the rate table every engine.
    labels = list(dict.fromkeys(e["label"] for e in parked["ranks"][0]["events"]))
    expected = ["build"] + [f"park {n} (after build)" for n in ex.ENGINES] + [
        "generate", "reload critic (for score)", "reload reference (for score)", "score",
        "park critic (after score)", "park reference (after score)", "reload actor (for train-actor)",
        "train-actor", "park actor (after train-actor)", "reload critic (for train-critic)", "train-critic",
        "park critic (after train-critic)",
    ]
    assert labels == expected
    rows = {line.split("│")[1].strip(): line for line in stdout.splitlines() if line.startswith("│ ")}
    for label in expected:
        assert label in rows, (label, stdout)
    for label in ("generate", "score", "train-actor", "train-critic"):  # the pass without parking beside
        assert rows[label].rstrip(" │").split("│")[-3].strip() != "-", rows[label]
    assert rows["park actor (after build)"].rstrip(" │").split("│")[-3].strip() == "-"
    for name in ex.ENGINES:
        assert name in rows, stdout
    assert "target: park/reload GB/s" in stdout and "target: memory falls" in stdout
    assert "state_report() of each engine at the end of train-actor" in stdout
    assert "critic:" in stdout and "nvme" in stdout

    for rank in range(world):
        events = parked["ranks"][rank]["events"]
        by_iteration = [[e["label"] for e in events if e["iteration"] == i] for i in range(2)]
        assert by_iteration[0] == by_iteration[1] == expected[4:]  # every iteration, the same phases
        msb = parked["ranks"][rank]["model_state_bytes"]
        for event in events:
            engines = event["engines"]
            if event["kind"] in ("train-actor", "train-critic"):
                training = event["kind"].removeprefix("train-")
                for name, info in engines.items():
                    if name == training:
                        assert info["parked"] == 0 and info["resident"] > 0, (event["label"], name, info)
                        assert info["devices"]["lp_params"] == ["cpu"]
                    else:  # parked on disk, the whole engine
                        assert info["resident"] == 0 and info["parked_on"] == {"nvme": info["parked"]}, info
                        for state in STATES:
                            assert info["devices"][state] == _where(info, state, "meta"), (name, state, info)
                        assert info["devices"]["contiguous_grad_buffer"] == []
                assert "nvme" in engines["critic" if training == "actor" else "actor"]["report"]
            if event["kind"] == "generate":  # the actor's weights are streamed while it is parked
                assert engines["actor"]["resident"] == 0 and event["streamed_bytes"] > 0
            if event["kind"] in ("park", "reload"):
                name = event["engine"]
                total = msb[name]["total"] - msb[name]["persistent_params"]
                assert msb[name]["persistent_params"] == 0  # stage3_param_persistence_threshold 0
                assert event["moved_bytes"] == total, (event["label"], event["moved_bytes"], msb[name])
                info = engines[name]
                if event["kind"] == "park":
                    assert info["parked"] == total and info["resident"] == 0, info
                else:  # back in memory, with a (re)created scratch bucket
                    scratch = sum(info["states"]["contiguous_grad_buffer"].values())
                    assert info["parked"] == 0 and info["resident"] == total + scratch, info
                    assert all(info["devices"][s] == _where(info, s, "cpu") for s in STATES), info
        rates = parked["ranks"][rank]["rates"]
        for name in ex.ENGINES:
            row = rates[name]
            assert row["moved_bytes"] == msb[name]["total"]
            assert row["park_gbps"] > 0 and row["reload_gbps"] > 0 and row["plain_out_gbps"] > 0
            assert len(row["fall_over_moved"]) == row["parks"] >= 2

        # Finite losses, and the same in both passes: parking and reloading change nothing.
        stats, plain_stats = parked["ranks"][rank]["stats"], plain["ranks"][rank]["stats"]
        assert len(stats) == 2
        assert all(math.isfinite(v) for s in stats for v in s.values()), stats
        assert stats == plain_stats
        assert parked["ranks"][rank]["stats"] == parked["ranks"][0]["stats"]  # one global mean

    assert document["targets"]["rate_target_applies"] is False  # disk: the target is for host memory
    assert (out / ex.PNG_NAME).read_bytes()[:8] == PNG_MAGIC
    if disk_root is not None:
        assert disk_root.is_dir() and not any(disk_root.rglob("*.bin"))  # every parked file was removed


def test_world_of_one_parks_to_disk_by_default_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    stdout = run_script([sys.executable, str(SCRIPT), *TINY, "--out", str(out)], tmp_path)
    first = stdout.splitlines()[0]
    assert "1 rank(s) on cpu, fp32, parking to nvme under " in first, stdout
    assert not Path(first.split(" under ")[1]).exists()  # its temporary directory is removed at the end
    check_run(stdout, out, 1, None)


def test_two_ranks_under_torchrun_park_to_the_given_directory(tmp_path: Path) -> None:
    out, disk = tmp_path / "out", tmp_path / "nvme"
    stdout = run_script([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         str(SCRIPT), *TINY, "--park", "nvme", "--nvme-path", str(disk), "--out", str(out)], tmp_path)
    assert "2 rank(s) on cpu" in stdout, stdout
    check_run(stdout, out, 2, disk)


def test_defaults_follow_the_device() -> None:
    ex = example()
    args = ex.parse_args([])
    ex.resolve_defaults(args, torch.device("cpu"))
    assert (args.park, args.precision) == ("nvme", "fp32")
    args = ex.parse_args([])
    ex.resolve_defaults(args, torch.device("cuda", 0))
    assert (args.park, args.precision) == ("cpu", "bf16")
    args = ex.parse_args(["--park", "none", "--precision", "bf16"])
    ex.resolve_defaults(args, torch.device("cpu"))
    assert (args.park, args.precision) == ("none", "bf16")


def test_bad_options_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    ex = example()
    with pytest.raises(SystemExit):
        ex.parse_args(["--n-embd", "30", "--n-head", "4"])
    assert "multiple of --n-head" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ex.parse_args(["--park", "cpu", "--nvme-path", "/tmp"])
    assert "--nvme-path is for --park nvme" in capsys.readouterr().err


def test_without_matplotlib_the_png_is_skipped_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ex = example()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    passes: list[dict[str, Any]] = [{"park": None, "ranks": [{"samples": [(0.0, 1)], "events": []}]}]
    assert ex.plot(tmp_path / ex.PNG_NAME, passes, torch.device("cpu")) is False
    assert "pip install zero3[plot]" in capsys.readouterr().out
    assert not (tmp_path / ex.PNG_NAME).exists()
