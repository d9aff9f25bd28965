"""A save with the last save's layout, written without DCP's exchanges (zero3.checkpoint.repeat_saves'
[Note: repeated saves]): its files are the ones `dcp.save` writes, torch's own tools read them, a rank
whose repeated save fails makes every rank raise and forget, and the next save goes through DCP again."""

from __future__ import annotations

import errno
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import zero3
from tests import models
from tests.distributed import run_ranks
from zero3.checkpoint import repeat_saves
from zero3.checkpoint.chunks import RangeChunks
from zero3.checkpoint.data_files import DataFileWriter
from zero3.checkpoint.tags import CheckpointError

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _counting_dcp_saves() -> list[str]:
    """Patch this process's `dcp.save` to record each call's directory (the saves that went through DCP)."""
    through_dcp: list[str] = []
    real = dcp.save

    def counted(*args: Any, **kwargs: Any) -> Any:
        through_dcp.append(Path(kwargs["storage_writer"].path).name)
        return real(*args, **kwargs)

    dcp.save = counted  # type: ignore[assignment]
    return through_dcp


def _train_step(engine: Any, rank: int, world: int, seed: int) -> None:
    x, y = models.batches("tokens", 1, 2 * world, seed=seed)[0]
    engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
    engine.step()


def _full_masters(engine: Any) -> dict[str, torch.Tensor]:
    return {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}


def _counted_engine_after_one_step(rank: int, world: int) -> tuple[list[str], Any]:
    """This process's DCP saves counted from now on, and an engine trained one step."""
    through_dcp = _counting_dcp_saves()
    torch.manual_seed(0)
    engine = zero3.initialize(model=models.TiedTransformer(), config=CONFIG)[0]
    _train_step(engine, rank, world, seed=0)
    return through_dcp, engine


def saved_twice_then_trained(rank: int, world: int, root: str) -> dict[str, Any]:
    through_dcp, engine = _counted_engine_after_one_step(rank, world)
    engine.save_checkpoint(root, tag="planned")
    engine.save_checkpoint(root, tag="repeated")  # the same state, the same layout
    _train_step(engine, rank, world, seed=1)
    engine.save_checkpoint(root, tag="after-a-step", async_save=True)  # async: the writer process
    engine.wait_for_checkpoint()
    expected = _full_masters(engine)
    _train_step(engine, rank, world, seed=2)
    engine.load_checkpoint(root, tag="after-a-step")
    restored = all(torch.equal(expected[name], value) for name, value in _full_masters(engine).items())
    engine.destroy()
    return {"through_dcp": through_dcp, "restored": restored}


def test_a_repeated_save_writes_the_files_dcp_writes_and_loads_exactly(tmp_path: Path) -> None:
    results = run_ranks(2, saved_twice_then_trained, str(tmp_path))
    for result in results:
        assert result["restored"], result
        # Only the first save went through dcp.save here (the async one is written by the writer process).
        assert result["through_dcp"] == [".planned.incomplete"], result["through_dcp"]
    planned, repeated = tmp_path / "planned", tmp_path / "repeated"
    names = sorted(path.name for path in planned.iterdir())
    assert names == sorted(path.name for path in repeated.iterdir())
    for name in names:
        if name.endswith(".distcp"):  # the same state: the same bytes, item for item
            assert (planned / name).read_bytes() == (repeated / name).read_bytes(), name
    with open(planned / ".metadata", "rb") as first, open(repeated / ".metadata", "rb") as second:
        dcp_metadata, repeated_metadata = pickle.load(first), pickle.load(second)
    assert repeated_metadata.state_dict_metadata == dcp_metadata.state_dict_metadata
    assert repeated_metadata.storage_data == dcp_metadata.storage_data
    assert repeated_metadata.planner_data == dcp_metadata.planner_data
    assert repeated_metadata.storage_meta.checkpoint_id != dcp_metadata.storage_meta.checkpoint_id  # its own tag's
    # torch's own tool reads the repeated save as the planned one.
    dcp_to_torch_save(planned, tmp_path / "planned.pt")
    dcp_to_torch_save(repeated, tmp_path / "repeated.pt")
    first_state = torch.load(tmp_path / "planned.pt", weights_only=True)
    second_state = torch.load(tmp_path / "repeated.pt", weights_only=True)
    assert first_state.keys() == second_state.keys() and len(first_state) > 0
    assert all(torch.equal(first_state[key], second_state[key]) for key in first_state)


def repeated_save_fails_on_rank_1(rank: int, world: int, root: str) -> dict[str, Any]:
    through_dcp, engine = _counted_engine_after_one_step(rank, world)
    engine.save_checkpoint(root, tag="first")
    real_write = DataFileWriter.write_data

    def full_disk(self: DataFileWriter, plan: Any, planner: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    if rank == 1:
        DataFileWriter.write_data = full_disk  # type: ignore[method-assign]
    _train_step(engine, rank, world, seed=1)
    try:
        engine.save_checkpoint(root, tag="failed")
        failure = ""
    except CheckpointError as error:
        failure = str(error)
    DataFileWriter.write_data = real_write  # type: ignore[method-assign]
    engine.save_checkpoint(root, tag="after-the-failure")  # through DCP again: rank 1 forgot
    engine.save_checkpoint(root, tag="repeated-again")
    expected = _full_masters(engine)
    _train_step(engine, rank, world, seed=2)
    engine.load_checkpoint(root)  # latest
    restored = all(torch.equal(expected[name], value) for name, value in _full_masters(engine).items())
    engine.destroy()
    return {"through_dcp": through_dcp, "failure": failure, "restored": restored}


def test_a_repeated_save_that_fails_on_one_rank_fails_on_every_rank_and_the_next_goes_through_dcp(
    tmp_path: Path,
) -> None:
    results = run_ranks(2, repeated_save_fails_on_rank_1, str(tmp_path))
    for result in results:
        assert "failed" in result["failure"] and "no space left on device" in result["failure"], result
        assert "'latest' still names 'first'" in result["failure"], result
        assert result["through_dcp"] == [".first.incomplete", ".after-the-failure.incomplete"], result["through_dcp"]
        assert result["restored"], result
    assert not (tmp_path / "failed").exists()
    assert (tmp_path / "latest").read_text().strip() == "repeated-again"


class _Heard:
    """Peers that answer a gather with what each rank said (this rank's own word first)."""

    def __init__(self, others: list[Any]) -> None:
        self.others = others

    def all_gather_objects(self, obj: Any) -> list[Any]:
        return [obj, *self.others]


def _remembered(key: str, state: dict[str, Any]) -> repeat_saves.LastSave:
    layout = repeat_saves.layout(state)
    assert layout is not None
    last = repeat_saves.LastSave(number=3, layout=layout, plan=None, results=[], metadata=None,  # type: ignore[arg-type]
                                 all_results=None)
    repeat_saves._last[key] = last
    return last


@pytest.mark.parametrize("case", ["agreed", "another rank forgot", "another rank remembers another save",
                                  "the layout changed", "an entry DCP pickles"])
def test_a_save_repeats_the_last_only_when_every_rank_remembers_it_with_this_layout(case: str) -> None:
    state: dict[str, Any] = {"model.w": RangeChunks((4, 6), torch.float32, 0, 12, values=torch.zeros(12)),
                             "optim.w.step": torch.tensor(3.0)}
    last = _remembered("key", state)
    others: list[Any] = [3]
    if case == "another rank forgot":
        others = [None]
    elif case == "another rank remembers another save":
        others = [2]
    elif case == "the layout changed":
        state["model.w"] = RangeChunks((4, 6), torch.float32, 0, 18, values=torch.zeros(18))
    elif case == "an entry DCP pickles":
        state["client"] = {"epoch": 1}
    found = repeat_saves.agreed(_Heard(others), "key", repeat_saves.layout(state))
    assert found is (last if case == "agreed" else None)
    assert "key" not in repeat_saves._last  # forgotten until the save is complete
