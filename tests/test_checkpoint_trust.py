"""A checkpoint from someone else runs no code: every file is read weights-only or through an allowlist
(DCP's metadata, its tensor items), a refused file is named with the global it names, and nothing changes."""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import zero3
from tests import models
from tests.devices import ON_DEVICES, worlds_on_devices
from tests.distributed import run_ranks
from zero3.checkpoint.tags import checksums, saved_checksum, write_engine_sum

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}},
    "fp16": {"enabled": True},  # the loss scaler's state is saved too
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


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
    x, y = (t.chunk(world)[rank].to(engine.device) for t in models.batches("tokens", 1, 2 * world, seed=seed)[0])
    loss = engine(x, y)
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
    write_engine_sum(file)  # checksums are not signatures: an attacker rewrites them too


def plant_in_metadata(tag_dir: Path, marker: str) -> None:
    file = tag_dir / ".metadata"
    with open(file, "rb") as f:
        metadata = pickle.load(f)  # the attacker's side
    metadata.planner_data = {"payload": Planted(marker)}  # a field no reader needs
    with open(file, "wb") as f:
        pickle.dump(metadata, f)
    engine_file = tag_dir / "zero3_engine.pt"
    state = torch.load(engine_file, weights_only=True)
    state["files"][".metadata"] = checksums([file], saved_checksum(state))[".metadata"]
    torch.save(state, engine_file)
    write_engine_sum(engine_file)


def refused_loads(rank: int, world: int, roots: list[str]) -> list[dict]:
    """Each tampered checkpoint in turn, on one engine: refused, nothing changed, training goes on."""
    engine, model = build(world)
    one_step(engine, rank, world)
    results = []
    for seed, root in enumerate(roots, start=1):
        before = {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
        with pytest.raises(zero3.CheckpointError) as info:
            engine.load_checkpoint(root, tag="t")
        unchanged = all(torch.equal(before[n], zero3.safe_get_full_fp32_param(p)) for n, p in model.named_parameters())
        loss = one_step(engine, rank, world, seed=seed)  # the engine goes on training
        results.append({"error": str(info.value), "unchanged": unchanged, "trains": math.isfinite(loss)})
    engine.destroy()
    return results


PLANTS = {"engine_file": ("zero3_engine.pt", plant_in_engine_file), "metadata": (".metadata", plant_in_metadata)}


def tampered(tmp_path: Path, world: int) -> tuple[list[Path], Path]:
    """One checkpoint saved at `world`, copied once per place a payload is planted."""
    saved, marker = tmp_path / f"saved{world}", tmp_path / "payload-ran"
    run_ranks(world, save, str(saved), PLAIN_CLIENT_STATE)
    roots = []
    for where, (_, plant) in PLANTS.items():
        root = tmp_path / f"{where}{world}"
        shutil.copytree(saved, root)
        plant(root / "t", str(marker))
        roots.append(root)
    return roots, marker


@worlds_on_devices(1, 2)
def test_a_planted_payload_is_refused_named_and_never_run(tmp_path: Path, world: int, device: str) -> None:
    roots, marker = tampered(tmp_path, world)
    per_rank = run_ranks(world, refused_loads, [str(root) for root in roots])
    assert not marker.exists()
    for case, (file, _) in enumerate(PLANTS.values()):
        results = [rank_results[case] for rank_results in per_rank]
        for result in results:
            assert file in result["error"] and "posix.system" in result["error"], result["error"]
            assert "weights_only=False" in result["error"]
            assert result["unchanged"] and result["trains"]
        assert len({result["error"] for result in results}) == 1  # the same error on every rank
    if world == 1:  # zero3 export of the same files: one line, non-zero, nothing written
        for root in roots:
            out = tmp_path / f"out-{root.name}"
            done = export(root, out)
            assert done.returncode != 0 and not marker.exists()
            assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
            assert "posix.system" in done.stderr and "--trust-checkpoint" in done.stderr
            assert not out.exists() or not any(out.iterdir())


@dataclass
class Exported:
    returncode: int
    stderr: str


def export(root: Path, out: Path, *extra: str) -> Exported:
    """`zero3 export`, run in this process (its exit status and what it printed on stderr)."""
    from zero3.cli import main

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        returncode = main(["export", str(root), str(out), *extra])
    return Exported(returncode, stderr.getvalue())


def round_trips(rank: int, world: int, root: str, ways: list[str]) -> list[dict]:
    """Load the checkpoint each way: "default", "trusted" (weights_only=False), "registered"
    (the default, after add_safe_globals)."""
    engine, _ = build(world)
    results = []
    for way in ways:
        if way == "registered":
            torch.serialization.add_safe_globals([Epoch])
        try:
            _, client = engine.load_checkpoint(root, tag="t", weights_only=way != "trusted")
            results.append({"client": client})
        except zero3.CheckpointError as error:
            results.append({"error": str(error)})
    engine.destroy()
    return results


def test_plain_client_state_round_trips_with_the_default(tmp_path: Path) -> None:
    run_ranks(2, save, str(tmp_path), PLAIN_CLIENT_STATE)
    for (result,) in run_ranks(2, round_trips, str(tmp_path), ["default"]):
        client = result["client"]
        assert {k: v for k, v in client.items() if k != "nested"} == {
            k: v for k, v in PLAIN_CLIENT_STATE.items() if k != "nested"}
        assert torch.equal(client["nested"]["t"], torch.arange(3))


@ON_DEVICES
def test_a_users_class_needs_the_opt_in(tmp_path: Path, device: str) -> None:
    run_ranks(1, save, str(tmp_path), {"epoch": Epoch(7)})
    ((refused, trusted, registered),) = run_ranks(1, round_trips, str(tmp_path), ["default", "trusted", "registered"])
    assert "test_checkpoint_trust.Epoch" in refused["error"] and "weights_only=False" in refused["error"]
    assert "add_safe_globals" in refused["error"]
    assert trusted["client"]["epoch"].value == 7
    assert registered["client"]["epoch"].value == 7  # add_safe_globals is honoured
    out = tmp_path / "out"
    assert export(tmp_path, out).returncode != 0
    done = export(tmp_path, out, "--trust-checkpoint")
    assert done.returncode == 0 and (out / "model.safetensors").exists(), done.stderr


def items_file(tmp_path: Path, objects: dict[str, object]) -> tuple[Path, dict[str, tuple[int, int]]]:
    """The objects `torch.save`d back to back after 3 bytes, as DCP writes a rank's items (at any offset)."""
    data, spans = bytearray(b"pad"), {}
    for name, value in objects.items():
        buffer = io.BytesIO()
        torch.save(value, buffer)
        spans[name] = (len(data), len(data) + len(buffer.getvalue()))
        data += buffer.getvalue()
    file = tmp_path / "__0_0.distcp"
    file.write_bytes(bytes(data))
    return file, spans


def test_a_dcp_item_reads_as_torch_load_reads_it_a_plain_one_as_a_view_of_the_file(tmp_path: Path) -> None:
    from zero3.checkpoint.tags import mapped
    from zero3.checkpoint.trust import tensor_item

    tensors = {
        "float32": torch.randn(5, 7), "bfloat16": torch.randn(3, 4).bfloat16(), "bool": torch.rand(6) > 0.5,
        "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4), "transposed": torch.randn(4, 6).t(),
        "part of a storage": torch.randn(10)[2:7],
        "uint16": torch.arange(5).to(torch.uint16),  # not a typed storage: read by torch.load
    }
    file, spans = items_file(tmp_path, tensors)
    view = mapped(file)
    for name, (start, end) in spans.items():
        read = tensor_item(view[start:end], file, name)
        expected = torch.load(io.BytesIO(view[start:end].tobytes()), weights_only=True)
        assert (read.dtype, read.shape, read.stride()) == (expected.dtype, expected.shape, expected.stride()), name
        assert torch.equal(read, expected), name
    first = tensor_item(view[slice(*spans["float32"])], file, "float32")
    mapping = torch.frombuffer(view, dtype=torch.uint8)
    assert mapping.data_ptr() <= first.data_ptr() < mapping.data_ptr() + len(view)  # nothing copied


def test_a_dcp_item_that_names_a_foreign_global_is_refused_named_and_never_run(tmp_path: Path) -> None:
    from zero3.checkpoint.tags import mapped
    from zero3.checkpoint.trust import tensor_item

    marker = tmp_path / "payload-ran"
    file, spans = items_file(tmp_path, {"planted": {"t": torch.zeros(2), "p": Planted(str(marker))}})
    with pytest.raises(zero3.CheckpointError) as info:
        tensor_item(mapped(file)[slice(*spans["planted"])], file, "item model.w at [0]")
    assert "__0_0.distcp" in str(info.value) and "item model.w at [0]" in str(info.value)
    assert "posix.system" in str(info.value) and not marker.exists()


def test_an_items_records_are_found_as_zipfile_finds_them(tmp_path: Path) -> None:
    """The central directory as torch.save writes it is read by hand (once per item, a few times faster
    than zipfile); any other archive (here, one with a comment) is left to zipfile, with the same records."""
    import zipfile

    from zero3.checkpoint.trust import _Bytes, _entries, _records

    for value in (torch.randn(3, 5), torch.tensor(2.0), {"a": torch.arange(4), "b": torch.ones(2, dtype=torch.bool)}):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        raw = memoryview(buffer.getvalue())
        listed = [(info.filename, info.compress_type, info.file_size, info.header_offset)
                  for info in zipfile.ZipFile(_Bytes(raw)).infolist()]
        assert _entries(raw) == listed
        commented = io.BytesIO(buffer.getvalue())
        with zipfile.ZipFile(commented, "a") as archive:
            archive.comment = b"not as torch writes it"
        other = memoryview(commented.getvalue())
        assert _entries(other) is None
        assert {name: bytes(data) for name, data in _records(other).items()} == \
            {name: bytes(data) for name, data in _records(raw).items()}


def test_an_engine_file_of_plain_values_is_read_without_torchs_python_unpickler(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors, plain containers, numbers and strings (an engine file's whole vocabulary) are read by the C
    unpickler under the items' allowlist, equal to what torch.load(weights_only=True) reads; anything else
    (a class the user registered) still goes to torch's reader, which honours the registration."""
    from collections import OrderedDict

    from zero3.checkpoint.trust import load_engine_file

    state = {"format": 1, "rank_states": [{"cpu": torch.get_rng_state(), "seed": 3}] * 2,
             "files": {"__0_0.distcp": (123, {0: (10, 2**63 + 5), 10: (7, 1)})}, "lr": [1e-3, 0.5],
             "loss_scaler": OrderedDict(scale=2.0**16), "view": torch.arange(12.0).view(3, 4)[1:, ::2],
             "shared": (torch.ones(2), None, True, "text", 2.5)}
    file = tmp_path / "zero3_engine.pt"
    torch.save(state, file)
    expected = torch.load(file, weights_only=True)
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("read by torch.load"))
    read = load_engine_file(file)
    assert read.keys() == expected.keys()
    for key in ("format", "files", "lr", "loss_scaler"):
        assert read[key] == expected[key], key
    assert isinstance(read["loss_scaler"], OrderedDict)
    for mine, theirs in ((read["view"], expected["view"]), (read["rank_states"][1]["cpu"], expected["rank_states"][1]["cpu"])):
        assert (mine.dtype, mine.shape, mine.stride()) == (theirs.dtype, theirs.shape, theirs.stride())
        assert torch.equal(mine, theirs)
    assert read["shared"][1:] == expected["shared"][1:] and torch.equal(read["shared"][0], expected["shared"][0])

    monkeypatch.setattr(torch, "load", real_load)
    torch.save({"format": 1, "client": Epoch(7)}, file)
    with pytest.raises(zero3.CheckpointError, match="Epoch"):
        load_engine_file(file)  # not plain: torch's reader refuses it
    with torch.serialization.safe_globals([Epoch]):
        assert load_engine_file(file)["client"].value == 7


def test_items_with_one_pickle_are_unpickled_once_and_read_as_torch_load_reads_each(tmp_path: Path) -> None:
    """A rank's items of one dtype and shape share their pickle: the first is unpickled and its recipe kept,
    the rest are that view of their own records, each equal to torch.load's reading of it."""
    from zero3.checkpoint import trust
    from zero3.checkpoint.tags import mapped

    tensors = {f"w{i}": torch.randn(6, 5) * i for i in range(4)}
    tensors |= {"t": torch.randn(5, 6).t(), "b": torch.randn(6, 5).bfloat16()}
    file, spans = items_file(tmp_path, tensors)
    view = mapped(file)
    trust._RECIPES.clear()
    unpickled = 0
    real_load = trust._ItemUnpickler.load_tensor

    def counted(self):  # type: ignore[no-untyped-def]
        nonlocal unpickled
        unpickled += 1
        return real_load(self)

    trust._ItemUnpickler.load_tensor = counted  # type: ignore[method-assign]
    try:
        for name, (start, end) in spans.items():
            read = trust.tensor_item(view[start:end], file, name)
            expected = torch.load(io.BytesIO(view[start:end].tobytes()), weights_only=True)
            assert (read.dtype, read.shape, read.stride()) == (expected.dtype, expected.shape, expected.stride()), name
            assert torch.equal(read, expected), name
    finally:
        trust._ItemUnpickler.load_tensor = real_load  # type: ignore[method-assign]
    assert unpickled == 3  # w0 (w1-w3 by its recipe), t (another stride), b (another dtype)
    assert len(trust._RECIPES) == 3
