"""A rank's DCP data file written in one pass (zero3.checkpoint.data_files' [Note: one pass per data file]).

Without torch's CRC a tensor's `torch.save` bytes are a fixed form around its data, so the writer writes
the form and the data, byte for byte what `torch.save` writes; the file goes out through one aligned
buffer with O_DIRECT (buffered where the filesystem refuses it, at open or at the first write); torch's
own DCP reader reads what it wrote, and each item's sum is the sum of its bytes in the file. A zero3 save
repeats its layout, so a repeated save makes no plan (zero3.checkpoint.repeat_saves), and engines of another
layout saving in the same processes still save and load exactly.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.utils.serialization.config as torch_serialization_config

import zero3
from tests import models
from tests.distributed import run_ranks
from tests.tmpfs import small_tmpfs
from zero3.checkpoint import data_files
from zero3.checkpoint.chunks import RangeChunks
from zero3.checkpoint.data_files import DataFileWriter, DirectFile, saved_form
from zero3.checkpoint.planners import SavePlanner
from zero3.checkpoint.staging import PAGE, place, views
from zero3.checkpoint.tags import XXH3_64, item_checksums

SPECS = [
    (torch.float32, (3, 5)), (torch.float32, ()), (torch.bfloat16, (7,)), (torch.float32, (0,)),
    (torch.int64, (2, 2, 2)), (torch.bool, (9,)), (torch.float32, (300, 100)),  # the last is over 64 KiB
]


@contextmanager
def crc(on: bool) -> Iterator[None]:
    """torch.save's zip CRC-32 on or off for the duration, then as it was (set through torch's config object
    itself: pytest's monkeypatch does not see its attributes, and would delete the setting when it undid)."""
    was = torch_serialization_config.save.compute_crc32
    torch_serialization_config.save.compute_crc32 = on
    try:
        yield
    finally:
        torch_serialization_config.save.compute_crc32 = was


@pytest.fixture
def without_crc() -> Iterator[None]:
    with crc(False):
        yield


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=generator)
    return torch.randn(shape, generator=generator).to(dtype)


def torch_saved(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(tensor, out)
    return out.getvalue()


@pytest.mark.usefixtures("without_crc")
@pytest.mark.parametrize("dtype,shape", SPECS)
def test_a_saved_form_around_the_data_is_torch_saves_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    form = saved_form(dtype, shape)
    assert form is not None
    for seed in (0, 1):
        tensor = sample(dtype, shape, seed)
        written = form.prefix + bytes(data_files._bytes_of(tensor)) + form.suffix
        assert written == torch_saved(tensor)
        assert torch.equal(torch.load(io.BytesIO(written), weights_only=True), tensor)


def test_with_torch_s_crc_on_there_is_no_form() -> None:
    assert torch_serialization_config.save.compute_crc32  # torch's default, the training process's
    assert saved_form(torch.float32, (3, 5)) is None


def o_direct_works(directory: Path) -> bool:
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False


def pieces() -> list[bytes]:
    """Pieces that cross the writer's 8 MiB buffer, and an unaligned end."""
    return [b"abc", os.urandom(9_000_001), b"", os.urandom(4096), os.urandom(8 << 20), b"tail"]


@pytest.mark.parametrize("direct", [True, False])
def test_a_direct_file_holds_what_was_written(tmp_path: Path, direct: bool) -> None:
    file = DirectFile(tmp_path / "data", direct)
    assert file.direct == (direct and o_direct_works(tmp_path))
    written = pieces()
    for piece in written:
        file.write(piece)
    assert file.tell() == sum(map(len, written))
    assert file.close() == sum(map(len, written))
    assert (tmp_path / "data").read_bytes() == b"".join(written)  # the O_DIRECT padding was cut off


@pytest.mark.parametrize("refused_at", ["open", "first write"])
def test_where_the_filesystem_refuses_o_direct_the_file_is_written_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_at: str,
) -> None:
    real_open, real_write = os.open, os.write
    refusals: list[str] = []

    def open_refusing(path: object, flags: int, *args: object) -> int:
        if refused_at == "open" and flags & os.O_DIRECT:
            refusals.append("open")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def write_refusing(fd: int, data: object) -> int:
        if refused_at == "first write" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refusals.append("write")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", open_refusing)
    monkeypatch.setattr(os, "write", write_refusing)
    file = DirectFile(tmp_path / "data")
    written = pieces()
    for piece in written:
        file.write(piece)
    file.close()
    assert refusals == ["open" if refused_at == "open" else "write"] and not file.direct
    assert (tmp_path / "data").read_bytes() == b"".join(written)


def test_large_bytes_go_to_the_file_from_their_own_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not o_direct_works(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: the buffered path is tested above")
    real_write = os.write
    sent: list[tuple[int, int]] = []

    def recorded(fd: int, data: object) -> int:
        view = memoryview(data)  # type: ignore[arg-type]
        sent.append((view.nbytes, ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else 0))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", recorded)
    file = DirectFile(tmp_path / "data")
    memory = torch.frombuffer(bytearray(os.urandom((2 << 20) + 3 * PAGE)), dtype=torch.uint8)
    aligned = memory[-memory.data_ptr() % PAGE :][: (1 << 20) + 123]  # starts on a page of memory
    unaligned = memory[-memory.data_ptr() % PAGE + (1 << 20) + 2 * PAGE + 1000 :][:300_000]  # 1000 bytes into one
    file.write(b"x" * 100)
    file.write_large(data_files._bytes_of(unaligned), unaligned.data_ptr())  # 100 into the file's page: copied
    file.write(bytes(-file.tell() % PAGE))
    file.write_large(data_files._bytes_of(aligned), aligned.data_ptr())
    file.write(bytes(1000 - file.tell() % PAGE))  # (its last 123 bytes are 123 into the file's page)
    file.write_large(data_files._bytes_of(unaligned), unaligned.data_ptr())  # 1000 into a page of both
    file.close()
    # The buffer went out up to the page the aligned bytes start at, then their whole pages straight from
    # them; then the buffer up to the page the unaligned bytes reach (their first 3096 bytes in it), then
    # their whole pages straight from them; their rest went out with the buffer at the close.
    first = -(-(100 + 300_000) // PAGE) * PAGE
    body = (300_000 - (PAGE - 1000)) // PAGE * PAGE
    assert sent == [(first, sent[0][1]), (1 << 20, aligned.data_ptr()), (PAGE, sent[2][1]),
                    (body, unaligned.data_ptr() + PAGE - 1000), (PAGE, sent[4][1])], sent
    expected = (b"x" * 100 + bytes(unaligned.numpy()) + bytes(-(100 + 300_000) % PAGE) + bytes(aligned.numpy())
                + bytes(1000 - 123) + bytes(unaligned.numpy()))
    assert (tmp_path / "data").read_bytes() == expected


@pytest.fixture
def one_mib_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "tmpfs", "1m") as root:
        yield root


@pytest.mark.parametrize("fills", ["the buffer's close", "large bytes"])
def test_a_full_disk_is_reported_as_one(one_mib_disk: Path, fills: str) -> None:
    """No space left is what the write says: the buffer a failed write still referred to did not turn it
    into a BufferError when the file let go of its memory."""
    file = DirectFile(one_mib_disk / "data")
    with pytest.raises(OSError) as raised:
        try:
            if fills == "large bytes":
                large = torch.frombuffer(bytearray(3 << 20), dtype=torch.uint8)
                large = large[-large.data_ptr() % PAGE :][: 2 << 20]
                file.write_large(data_files._bytes_of(large), large.data_ptr())
            else:
                file.write(os.urandom(3 << 20))  # under the buffer's 8 MiB: it all goes out at the close
            file.close()
        except BaseException:
            file.abandon()
            raise
    assert raised.value.errno == errno.ENOSPC, raised.value


def test_staged_boxes_have_places_of_their_own_and_large_ones_start_on_a_page() -> None:
    values = torch.randn(300 * 100)
    live = {"scalar": torch.tensor(2.0), "weight": RangeChunks((300, 100), torch.float32, 50, 29_950, values[50:29_950])}
    placements, size = place(live)
    weight = placements[1]
    assert [sizes for _, sizes in live["weight"].boxes] == [[1, 50], [298, 100], [1, 50]]
    assert weight.box_offsets[1] % PAGE == 0 and weight.box_offsets[0] % 64 == 0 and weight.box_offsets[2] % 64 == 0
    segment = memoryview(bytearray(size))
    arena = torch.frombuffer(segment, dtype=torch.uint8)
    for placed in placements:  # as StagingArena.stage copies them
        if placed.chunks is None:
            arena[placed.offset : placed.offset + placed.nbytes].view(placed.dtype).copy_(live[placed.key].reshape(-1))
    cursor = 0
    for at, (_, sizes) in zip(weight.box_offsets, live["weight"].boxes):
        count = sizes[0] * sizes[1]
        arena[at : at + 4 * count].view(torch.float32).copy_(values[50 + cursor : 50 + cursor + count])
        cursor += count
    staged = views((segment, None), placements)
    for offsets, _ in live["weight"].boxes:
        assert torch.equal(staged["weight"].box(torch.Size(offsets))[1], live["weight"].box(torch.Size(offsets))[1])
    assert torch.equal(staged["scalar"], live["scalar"])


def state() -> dict[str, torch.Tensor]:
    base = torch.arange(40, dtype=torch.float32)
    return {
        "big": sample(torch.float32, (300, 100), 0),
        "view": base[5:17].view(3, 4),  # a view of a larger storage: the item is its 12 values, not 40
        "transposed": sample(torch.float32, (4, 6), 1).t(),  # not contiguous
        "scalar": torch.tensor(3.0),
        "half": sample(torch.bfloat16, (5, 3), 2),
        "empty": torch.zeros(0),
    }


@pytest.mark.parametrize("crc_is", ["on", "off"])
def test_torch_s_reader_reads_the_file_and_each_item_s_sum_is_its_bytes_in_the_file(tmp_path: Path, crc_is: str) -> None:
    saved = state()
    writer = DataFileWriter(tmp_path, XXH3_64)
    planner = SavePlanner()
    with crc(crc_is == "on"):
        dcp.save(saved, storage_writer=writer, planner=planner)  # no process group: one rank
    assert planner.is_coordinator  # DCP set the planner up the current way (it reads the signature)
    assert list(writer.sums) == ["__0_0.distcp"]
    size, sums = writer.sums["__0_0.distcp"]
    file = tmp_path / "__0_0.distcp"
    assert size == file.stat().st_size
    assert item_checksums(file, [(offset, length) for offset, (length, _) in sums.items()], XXH3_64) == (size, sums)

    loaded = {key: torch.full_like(value, 7) for key, value in saved.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path))  # torch's own FileSystemReader
    assert all(torch.equal(loaded[key], saved[key]) for key in saved)

    with open(tmp_path / ".metadata", "rb") as source:
        where = {index.fqn: info for index, info in pickle.load(source).storage_data.items()}
    raw = file.read_bytes()
    for key, tensor in saved.items():
        item = raw[where[key].offset : where[key].offset + where[key].length]
        assert torch.equal(torch.load(io.BytesIO(item), weights_only=True), tensor)
        if crc_is == "off":  # the form's bytes are torch.save's, to the byte
            with crc(False):
                assert item == torch_saved(tensor.contiguous().clone())
    if crc_is == "off" and o_direct_works(tmp_path):  # a large item's data sits where it does in a page of memory
        with crc(False):
            form = saved_form(torch.float32, (300, 100))
        assert form is not None and (where["big"].offset + len(form.prefix)) % PAGE == saved["big"].data_ptr() % PAGE
    assert where["view"].length < len(torch_saved(torch.arange(40, dtype=torch.float32)))


CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def saved_in_turns(rank: int, world: int, root: str) -> dict:
    sent: list[int] = []
    make_plan = SavePlanner.create_local_plan

    def recorded(self: SavePlanner) -> object:
        plan = make_plan(self)
        sent.append(len(plan.items))
        return plan

    SavePlanner.create_local_plan = recorded  # type: ignore[method-assign]
    torch.manual_seed(0)
    engines = {"first": zero3.initialize(model=models.TiedTransformer(), config=CONFIG)[0],
               "other": zero3.initialize(model=models.MLP(), config=CONFIG)[0]}
    kinds = {"first": "tokens", "other": "x"}
    expected = {}
    for seed, tag in enumerate(("first-1", "first-2", "other-1", "first-3", "other-2")):
        name = tag.split("-")[0]
        engine = engines[name]
        x, y = models.batches(kinds[name], 1, 2 * world, seed=seed)[0]
        engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
        engine.step()  # each save holds new values
        engine.save_checkpoint(Path(root) / name, tag=tag)
        expected[tag] = {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    restored = {}
    for tag, engine_name in (("first-2", "first"), ("other-2", "other"), ("first-3", "first")):
        engine = engines[engine_name]
        engine.load_checkpoint(Path(root) / engine_name, tag=tag)
        restored[tag] = all(torch.equal(expected[tag][n], zero3.safe_get_full_fp32_param(p))
                            for n, p in engine.module.named_parameters())
    for engine in engines.values():
        engine.destroy()
    return {"sent": sent, "restored": restored}


def test_a_repeated_save_makes_no_plan_and_engines_saving_in_turns_save_exactly(tmp_path: Path) -> None:
    results = run_ranks(2, saved_in_turns, str(tmp_path))
    for result in results:
        assert all(result["restored"].values()), result
        # Each engine plans its first save only: its later ones repeat it (zero3.checkpoint.repeat_saves).
        assert len(result["sent"]) == 2 and all(items > 0 for items in result["sent"]), result["sent"]
    metadata = []
    for tag in ("first-1", "first-2", "first-3"):
        with open(tmp_path / "first" / tag / ".metadata", "rb") as source:
            metadata.append(pickle.load(source))
    assert metadata[0].state_dict_metadata == metadata[1].state_dict_metadata == metadata[2].state_dict_metadata
    assert metadata[0].storage_data == metadata[1].storage_data == metadata[2].storage_data
    # The names DCP records are the flat ones (`model.<name>`), as torch's own tools read them.
    assert metadata[0].planner_data == {fqn: (fqn,) for fqn in metadata[0].state_dict_metadata}
