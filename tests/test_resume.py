"""Resuming a job: DeepSpeed's resume idiom, automatic checkpoints from the config, registered state and
random generators restored, the global batch across world sizes (in processes; kills are in
tests/test_restarts.py)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zero3
from tests import models, restart_job
from tests.distributed import run_ranks
from zero3.config import load_config

CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def resume_idiom(rank: int, world: int, root: str) -> dict[str, Any]:
    warnings = restart_job.Warnings()
    logging.getLogger("zero3").addHandler(warnings)
    torch.manual_seed(0)
    engine, *_ = zero3.initialize(model=models.TiedTransformer(), config=CFG)
    out: dict[str, Any] = {}
    # The idiom of every DeepSpeed script: the first run finds nothing, and goes on from step 0.
    path, client = engine.load_checkpoint(os.path.join(root, "absent"))
    start = client["step"] if path is not None else 0
    out["absent"] = (path, client, start)
    os.makedirs(os.path.join(root, "empty"), exist_ok=True)
    out["empty"] = engine.load_checkpoint(os.path.join(root, "empty"))
    out["warnings"] = list(warnings.messages)
    for case, where, tag in (("absent_tag", "absent", "global_step1"), ("missing_tag", "empty", "global_step1")):
        try:
            engine.load_checkpoint(os.path.join(root, where), tag=tag)
            out[case] = "no error"
        except zero3.CheckpointError as error:
            out[case] = str(error)
    models.train_steps(engine, rank, world, models.batches("tokens", 1, 2 * world))
    engine.save_checkpoint(os.path.join(root, "empty"), client_state={"step": engine.global_steps})
    path, client = engine.load_checkpoint(os.path.join(root, "empty"))
    out["saved"] = (os.path.basename(path), client, engine.client_state)
    engine.destroy()
    return out


def test_load_checkpoint_of_a_directory_without_a_checkpoint_returns_none_with_one_warning(tmp_path: Path) -> None:
    first, second = run_ranks(2, resume_idiom, str(tmp_path))
    assert first["absent"] == (None, None, 0) and first["empty"] == (None, None)
    assert second["absent"] == (None, None, 0) and second["warnings"] == []  # one warning per call: rank 0's
    assert len(first["warnings"]) == 2 and all("holds no checkpoint yet" in line for line in first["warnings"])
    assert "does not exist" in first["absent_tag"]  # an explicit tag still has to be there
    assert "'global_step1' not found" in first["missing_tag"]
    assert first["saved"] == ("global_step1", {"step": 1}, {"step": 1})


# ---- automatic checkpoints and resume from the config ------------------------------------------------------
def job(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    restart_job.train(argv)
    return {}


def job_outputs(out: Path, world: int) -> dict[str, Any]:
    losses = {path.name: path.read_text() for path in sorted(out.glob("loss_*"))}
    final = torch.load(out / "final.pt")
    draws = [json.loads((out / f"final_r{rank}.json").read_text()) for rank in range(world)]
    return {"losses": losses, "final": final, "draws": draws}


def same_outputs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["losses"] == b["losses"] and a["draws"] == b["draws"]
            and all(torch.equal(a["final"][name], b["final"][name]) for name in a["final"]))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("uninterrupted")
    (root / "out").mkdir()
    run_ranks(2, job, [str(root / "out"), "--ckpt", str(root / "ckpt"), "--steps", "6", "--interval", "2"])
    return job_outputs(root / "out", 2)


def test_a_job_stopped_and_started_again_resumes_bit_exactly_from_its_automatic_checkpoints(
    uninterrupted: dict[str, Any], tmp_path: Path,
) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    common = [str(out), "--ckpt", str(ckpt), "--interval", "2", "--async-save"]
    run_ranks(2, job, [*common, "--steps", "5"])  # saves at 2 and 4 (in the background), then stops
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step2", "global_step4", "latest"]
    run_ranks(2, job, [*common, "--steps", "6"])  # resumes at 4 from the config, redoes 5, then 6
    attempt = json.loads((out / "attempt0_r1.json").read_text())
    assert attempt["resumed_at"] == 4 and attempt["client_state"] == {"step": 4} and attempt["sampler_restored"]
    assert same_outputs(job_outputs(out, 2), uninterrupted)  # losses, masters, each rank's next random draw
    # keep_last 2: global_step2 is kept aside for the next save to write over (tags' [Note: recycled data files])
    assert sorted(p.name for p in ckpt.iterdir()) == [".recycled", "global_step4", "global_step6", "latest"]


def test_a_checkpoint_resumes_at_another_world_size_keeping_the_global_batch(tmp_path: Path) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    common = [str(out), "--ckpt", str(ckpt), "--interval", "2"]
    run_ranks(4, job, [*common, "--steps", "2"])
    run_ranks(2, job, [*common, "--steps", "4"])
    attempt = json.loads((out / "attempt0_r0.json").read_text())
    assert attempt["resumed_at"] == 2 and attempt["world"] == 2
    assert attempt["gas"] == 2  # train_batch_size 8 = micro 2 x 2 ranks x 2: four ranks had 1
    assert not attempt["sampler_restored"]  # per-rank state stays with the world it was saved in
    assert any("saved at world size 4, loaded at 2" in line and "['sampler']" in line for line in attempt["warnings"])
    assert not any("global batch changes" in line for line in attempt["warnings"])
    assert json.loads((out / "final_r1.json").read_text())["steps"] == 4
    run_ranks(2, job, [*common, "--steps", "5", "--global-batch", "4"])  # a batch the world cannot keep
    attempt = json.loads((out / "attempt0_r0.json").read_text())
    assert attempt["resumed_at"] == 4
    (changed,) = [line for line in attempt["warnings"] if "global batch changes" in line]
    assert "from 8 (world 2: micro 2 x accumulation 2) to 4 (world 2: micro 2 x accumulation 1)" in changed


def test_a_resuming_job_keeps_train_batch_size_by_its_accumulation_at_another_world_size() -> None:
    written_for_four = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    resuming = load_config({**written_for_four, "checkpoint": {"dir": "ckpt", "resume": True}})
    assert resuming.resolve_batch(4).gradient_accumulation_steps == 2
    assert resuming.resolve_batch(2).gradient_accumulation_steps == 4
    assert resuming.resolve_batch(8).gradient_accumulation_steps == 1
    with pytest.raises(zero3.ConfigError, match="train_batch_size must equal"):
        load_config(written_for_four).resolve_batch(2)  # DeepSpeed's rule where no resume is asked for
    with pytest.raises(zero3.ConfigError, match="world_size=3: 2 \\* 2 \\* 3 = 12"):
        resuming.resolve_batch(3)  # 16 rows cannot be split over 3 ranks of 2


# ---- the config section and registration -----------------------------------------------------------------
def test_the_checkpoint_section_takes_deepspeeds_keys_and_refuses_what_cannot_work() -> None:
    cfg = load_config({"checkpoint": {"dir": "ckpt", "interval_steps": 100, "async_save": True, "keep_last": 2,
                                      "resume": True, "tag_validation": "Warn", "use_node_local_storage": False}})
    assert cfg.checkpoint.automatic and cfg.checkpoint.tag_validation == "WARN"
    assert not load_config({}).checkpoint.automatic
    for section, expected in (
        ({"interval_steps": 10}, "checkpoint.interval_steps: needs checkpoint.dir"),
        ({"resume": True}, "checkpoint.resume: needs checkpoint.dir"),
        ({"dir": "c", "interval_steps": 0}, "checkpoint.interval_steps"),
        ({"dir": "c", "keep_last": 0}, "checkpoint.keep_last"),
        ({"dir": "c", "load_universal": True}, "checkpoint.load_universal"),
        ({"dir": "c", "tag_validation": "Sometimes"}, "checkpoint.tag_validation"),
    ):
        with pytest.raises(zero3.ConfigError, match=expected):
            load_config({"checkpoint": section})


class NotStateful:
    def state_dict(self) -> dict:
        return {}


def registration(rank: int, world: int) -> dict[str, str]:
    engine, *_ = zero3.initialize(model=torch.nn.Linear(4, 4), config=CFG)
    out = {}
    for case, name, obj in (("bad_name", "", restart_job.GlobalSampler(2)), ("no_load", "x", NotStateful())):
        try:
            engine.register_checkpoint_state(name, obj)
        except (TypeError, ValueError) as error:
            out[case] = str(error)
    engine.register_checkpoint_state("sampler", restart_job.GlobalSampler(2))
    try:
        engine.register_checkpoint_state("sampler", restart_job.GlobalSampler(2))
    except ValueError as error:
        out["taken"] = str(error)
    engine.destroy()
    return out


def test_register_checkpoint_state_refuses_what_it_cannot_save() -> None:
    (out,) = run_ranks(1, registration)
    assert "non-empty string" in out["bad_name"]
    assert "NotStateful has no load_state_dict" in out["no_load"]
    assert "'sampler' is already registered" in out["taken"]
