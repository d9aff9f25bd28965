"""A checkpoint from someone else runs no code: every file is read weights-only or through DCP's
metadata allowlist, a refused file is named with the global it names, and nothing changes."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks, script_env

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}},
    "fp16": {"enabled": True},  # the loss scaler's state is saved too
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
REPO = str(Path(__file__).resolve().parents[1])


class Planted:
    """What an attacker adds: unpickling it runs os.system, which creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


class Epoch:
    """A user's own class in client_state (needs the opt-in)."""

    def __init__(self, value: int) -> None:
        self.value = value


PLAIN_CLIENT_STATE = {"epoch": 3, "name": "run", "done": False, "none": None, "steps": [1, 2.5], "pair": (1, "a"),
                      "nested": {"t": torch.arange(3)}}


def build(world: int) -> tuple[zero3.ZeroEngine, torch.nn.Module]:
    torch.manual_seed(0)
    model = models.TiedTransformer()
    return zero3.initialize(model=model, config=CONFIG)[0], model


def one_step(engine: zero3.ZeroEngine, rank: int, world: int, seed: int = 0) -> float:
    x, y = models.batches("tokens", 1, 2 * world, seed=seed)[0]
    loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
    engine.backward(loss)
    engine.step()
    return loss.item()


def save(rank: int, world: int, root: str, client_state: object) -> None:
    engine, _ = build(world)
    one_step(engine, rank, world)
    engine.save_checkpoint(root, tag="t", client_state=client_state)
    engine.destroy()


def plant_in_engine_file(tag_dir: Path, marker: str) -> None:
    file = tag_dir / "zero3_engine.pt"
    state = torch.load(file, weights_only=False)  # the attacker's side: this file is their own
    state["client_state"] = {"epoch": 3, "payload": Planted(marker)}
    torch.save(state, file)


def plant_in_metadata(tag_dir: Path, marker: str) -> None:
    file = tag_dir / ".metadata"
    with open(file, "rb") as f:
        metadata = pickle.load(f)  # the attacker's side
    metadata.planner_data = {"payload": Planted(marker)}  # a field no reader needs
    with open(file, "wb") as f:
        pickle.dump(metadata, f)


def refused_load(rank: int, world: int, root: str) -> dict:
    engine, model = build(world)
    one_step(engine, rank, world)
    before = {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    with pytest.raises(zero3.CheckpointError) as info:
        engine.load_checkpoint(root, tag="t")
    unchanged = all(torch.equal(before[n], zero3.safe_get_full_fp32_param(p)) for n, p in model.named_parameters())
    loss = one_step(engine, rank, world, seed=1)  # the engine goes on training
    engine.destroy()
    return {"error": str(info.value), "unchanged": unchanged, "trains": bool(torch.isfinite(torch.tensor(loss)))}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("where", ["engine_file", "metadata"])
def test_a_planted_payload_is_refused_named_and_never_run(tmp_path: Path, where: str, world: int) -> None:
    root = tmp_path / "ckpt"
    marker = tmp_path / "payload-ran"
    run_ranks(world, save, str(root), PLAIN_CLIENT_STATE)
    (plant_in_engine_file if where == "engine_file" else plant_in_metadata)(root / "t", str(marker))
    results = run_ranks(world, refused_load, str(root))
    assert not marker.exists()
    file = "zero3_engine.pt" if where == "engine_file" else ".metadata"
    for result in results:
        assert file in result["error"] and "posix.system" in result["error"], result["error"]
        assert "weights_only=False" in result["error"]
        assert result["unchanged"] and result["trains"]
    assert len({result["error"] for result in results}) == 1  # the same error on every rank


def export(root: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zero3.cli", "export", str(root), str(out), *extra],
        capture_output=True, text=True, env=script_env(REPO), timeout=120,
    )


@pytest.mark.parametrize("where", ["engine_file", "metadata"])
def test_export_of_a_tampered_checkpoint_says_one_line_and_writes_nothing(tmp_path: Path, where: str) -> None:
    root, out, marker = tmp_path / "ckpt", tmp_path / "out", tmp_path / "payload-ran"
    run_ranks(1, save, str(root), None)
    (plant_in_engine_file if where == "engine_file" else plant_in_metadata)(root / "t", str(marker))
    done = export(root, out)
    assert done.returncode != 0 and not marker.exists()
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "posix.system" in done.stderr and "--trust-checkpoint" in done.stderr
    assert not out.exists() or not any(out.iterdir())


def round_trip(rank: int, world: int, root: str, weights_only: bool, register: bool) -> dict:
    if register:
        torch.serialization.add_safe_globals([Epoch])
    engine, _ = build(world)
    try:
        path, client = engine.load_checkpoint(root, tag="t", weights_only=weights_only)
        return {"client": client}
    except zero3.CheckpointError as error:
        return {"error": str(error)}
    finally:
        engine.destroy()


def test_plain_client_state_round_trips_with_the_default(tmp_path: Path) -> None:
    run_ranks(2, save, str(tmp_path), PLAIN_CLIENT_STATE)
    for result in run_ranks(2, round_trip, str(tmp_path), True, False):
        client = result["client"]
        assert {k: v for k, v in client.items() if k != "nested"} == {
            k: v for k, v in PLAIN_CLIENT_STATE.items() if k != "nested"}
        assert torch.equal(client["nested"]["t"], torch.arange(3))


def test_a_users_class_needs_the_opt_in(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_ranks(1, save, str(tmp_path), {"epoch": Epoch(7)})
    (refused,) = run_ranks(1, round_trip, str(tmp_path), True, False)
    assert "test_checkpoint_trust.Epoch" in refused["error"] and "weights_only=False" in refused["error"]
    assert "add_safe_globals" in refused["error"]
    (trusted,) = run_ranks(1, round_trip, str(tmp_path), False, False)
    assert trusted["client"]["epoch"].value == 7
    (registered,) = run_ranks(1, round_trip, str(tmp_path), True, True)  # add_safe_globals is honoured
    assert registered["client"]["epoch"].value == 7
    out = tmp_path / "out"
    assert export(tmp_path, out).returncode != 0
    done = export(tmp_path, out, "--trust-checkpoint")
    assert done.returncode == 0 and (out / "model.safetensors").exists(), done.stderr
