"""The offload tiers (ZeRO-Offload / ZeRO-Infinity): optimizer and parameters on the host or on disk.

Each scenario runs once in spawned ranks (a module fixture per world size)
and the tests read its results, so the whole matrix costs a few launches.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import zero3
from tests import models
from tests.devices import ON_DEVICES
from tests.distributed import run_ranks
from zero3 import OffloadStateType
from zero3.offload import disk as disk_io
from zero3.offload.disk import StepIOError

STEPS = 4
SUB_GROUP = 1500  # several sub-groups per rank (the disk walk rotates its windows); MLP shards are cut


def tiers(root: str) -> dict[str, dict]:
    """Each tier the issue names, on top of the in-memory engine ("none")."""
    nvme = {"device": "nvme", "nvme_path": root}
    return {
        "none": {},
        "optimizer_cpu": {"offload_optimizer": {"device": "cpu"}},
        "optimizer_nvme": {"offload_optimizer": {**nvme, "buffer_count": 2}},
        "params_cpu": {"offload_param": {"device": "cpu"}},
        "params_nvme": {"offload_param": {**nvme, "max_in_cpu": 0, "buffer_count": 2}},
        "both_nvme": {"offload_param": {**nvme, "max_in_cpu": 4000}, "offload_optimizer": nvme},
    }


def config(zero: dict, precision: str = "fp32", **extra: Any) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64, "sub_group_size": SUB_GROUP,
                              **zero},
        "aio": {"block_size": 4096, "queue_depth": 4, "thread_count": 2},
        **extra,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def build(zero: dict, name: str = "tied_transformer", precision: str = "fp32") -> tuple[zero3.ZeroEngine, Any]:
    cls = {"tied_transformer": models.TiedTransformer, "branchy": models.Branchy}[name]
    torch.manual_seed(0)
    model = cls()
    engine, *_ = zero3.initialize(model=model, config=config(zero, precision))
    return engine, model


def kind_of(name: str) -> str:
    return {"tied_transformer": "tokens", "branchy": "branch"}[name]


train = models.train_steps


def local_state(engine: zero3.ZeroEngine, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"{name}/lp"] = zero3.safe_get_local_lp_param(p).clone()
        out[f"{name}/hp"] = zero3.safe_get_local_fp32_param(p).clone()
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{moment}"] = zero3.safe_get_local_optimizer_state(p, moment).clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class InFlight:
    """Counts the disk requests running at once (the I/O threads' pread/pwrite calls)."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.lock = threading.Lock()

    def wrap(self, fn: Any) -> Any:
        def counted(*args: Any) -> Any:
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                return fn(*args)
            finally:
                with self.lock:
                    self.now -= 1

        return counted


def record_writes(engine: zero3.ZeroEngine) -> list[str]:
    """The names of the files the engine's disk layer writes from now on."""
    names: list[str] = []
    write = engine.parts.disk.write

    def recorded(file: Any, source: torch.Tensor, offset: int = 0) -> Any:
        names.append(file.path.name)
        return write(file, source, offset)

    engine.parts.disk.write = recorded  # type: ignore[method-assign]
    return names


# ---- 2, 3, 4: parity of every tier, requests in flight, no gradient swapping, reads ahead --------------
def parity(rank: int, world: int, root: str) -> dict:
    out: dict[str, Any] = {"losses": {}, "homes": {}, "devices": {}, "files": {}}
    in_flight = InFlight()
    disk_io._pread_all = in_flight.wrap(disk_io._pread_all)  # type: ignore[assignment]
    disk_io._pwrite_all = in_flight.wrap(disk_io._pwrite_all)  # type: ignore[assignment]
    for precision in ("fp32", "bf16"):
        for name, zero in tiers(root).items():
            if precision == "bf16" and name not in ("none", "both_nvme"):
                continue
            key = f"{name}/{precision}"
            engine, _ = build(zero, precision=precision)
            batches = models.batches("tokens", STEPS, 4 * world)
            losses = train(engine, rank, world, batches[:-1])
            written = record_writes(engine)
            in_flight.most = 0
            losses += train(engine, rank, world, batches[-1:])
            out["in_flight"] = max(out.get("in_flight", 0), in_flight.most) if "nvme" in name else out.get("in_flight", 0)
            out["losses"][key] = losses
            out["files"][key] = sorted({n.rsplit(".", 2)[0] for n in written})
            out["homes"][key] = engine.state_report().homes
            out["devices"][key] = {s.value: {str(d) for d in zero3.get_state_devices(engine, s)} for s in OffloadStateType}
            if engine.parts.param_disk is not None:
                out.setdefault("reads", {})[key] = (engine.parts.param_disk.reads_ahead_used, engine.parts.param_disk.reads_on_demand)
            if name == "optimizer_nvme" and precision == "fp32":
                optimizer = engine.optimizer
                out["sub_groups"] = {
                    "largest": max(sub.numel for sub in optimizer.sub_groups),
                    "largest_shard": max(sp.shard_numel for sp in optimizer.params),
                    "split": sum(piece.start > 0 for sub in optimizer.sub_groups for piece in sub.pieces),
                    "window": optimizer.states.window_numel,
                }
            engine.destroy()
    # The same in-memory run with sub-groups larger than the model: no shard is cut in pieces.
    engine, _ = build({"sub_group_size": 10**9})
    out["losses"]["whole_sub_group/fp32"] = train(engine, rank, world, models.batches("tokens", STEPS, 4 * world))
    engine.destroy()
    # A forward whose module order changes from step to step, with every shard on disk.
    for name in ("none", "params_nvme"):
        engine, _ = build(tiers(root)[name], name="branchy")
        out["losses"][f"branchy/{name}"] = train(engine, rank, world, models.batches("branch", 6, 4 * world))
        if engine.parts.param_disk is not None:
            out["reads"]["branchy"] = (engine.parts.param_disk.reads_ahead_used, engine.parts.param_disk.reads_on_demand)
        engine.destroy()
    out["left"] = sorted(os.listdir(root))
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def parity_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("tiers")
    return run_ranks(request.param, parity, str(root))


@pytest.mark.parametrize("tier", ["optimizer_cpu", "optimizer_nvme", "params_cpu", "params_nvme", "both_nvme"])
def test_every_tier_gives_the_in_memory_losses_bit_for_bit(parity_results: list[dict], tier: str) -> None:
    for result in parity_results:
        assert result["losses"][f"{tier}/fp32"] == result["losses"]["none/fp32"]
    assert parity_results[0]["losses"]["none/fp32"][-1] < parity_results[0]["losses"]["none/fp32"][0]


def test_sub_groups_cut_large_shards_and_stepping_in_pieces_changes_nothing(parity_results: list[dict]) -> None:
    for result in parity_results:
        cut = result["sub_groups"]
        assert cut["largest_shard"] > SUB_GROUP  # so some shard must be cut
        assert cut["split"] > 0 and cut["largest"] <= SUB_GROUP and cut["window"] <= SUB_GROUP
        assert result["losses"]["none/fp32"] == result["losses"]["whole_sub_group/fp32"]


def test_bf16_with_everything_on_disk_gives_the_in_memory_losses(parity_results: list[dict]) -> None:
    for result in parity_results:
        assert result["losses"]["both_nvme/bf16"] == result["losses"]["none/bf16"]


def test_each_tier_keeps_its_states_where_the_config_says(parity_results: list[dict]) -> None:
    homes = parity_results[0]["homes"]
    devices = parity_results[0]["devices"]
    # In memory, an fp32 engine's masters are its shards: hp_params is where lp_params is, with no bytes of
    # its own; a 16-bit engine's masters, and ZeRO-Offload's, are a buffer of their own.
    assert homes["none/fp32"]["hp_params"] == {"cpu": 0} and set(homes["none/fp32"]["lp_params"]) == {"cpu"}
    assert homes["none/bf16"]["hp_params"]["cpu"] > 0 and homes["optimizer_cpu/fp32"]["hp_params"]["cpu"] > 0
    assert set(homes["optimizer_nvme/fp32"]["hp_params"]) == {"nvme"}
    assert set(homes["optimizer_nvme/fp32"]["optim_states"]) == {"nvme"}
    assert set(homes["optimizer_nvme/fp32"]["lp_grads"]) == {"cpu"}  # the 16-bit gradients stay in memory
    assert devices["optimizer_nvme/fp32"]["hp_params"] == {"meta"}  # memory holds none of it
    assert set(homes["params_nvme/fp32"]["lp_params"]) == {"cpu", "nvme"}  # the persistent unit stays in memory
    assert devices["params_nvme/fp32"]["lp_params"] == {"cpu", "meta"}
    assert set(homes["both_nvme/fp32"]["optim_states"]) == {"nvme"}


def test_a_disk_step_keeps_several_requests_in_flight_and_never_swaps_gradients(parity_results: list[dict]) -> None:
    result = parity_results[0]
    assert result["in_flight"] >= 2
    assert result["files"]["optimizer_nvme/fp32"] == ["exp_avg", "exp_avg_sq", "hp_params"]
    assert result["files"]["both_nvme/fp32"] == ["exp_avg", "exp_avg_sq", "hp_params", "lp_params"]
    assert result["files"]["none/fp32"] == [] and result["files"]["optimizer_cpu/fp32"] == []


def test_shards_on_disk_are_read_ahead_and_a_changed_order_reads_on_demand(parity_results: list[dict]) -> None:
    for result in parity_results:
        ahead, _ = result["reads"]["params_nvme/fp32"]
        assert ahead > 0
        assert result["losses"]["branchy/params_nvme"] == result["losses"]["branchy/none"]


def test_destroy_removes_every_tier_file(parity_results: list[dict]) -> None:
    assert all(result["left"] == [] for result in parity_results)


@pytest.mark.cuda
def test_every_tier_on_cuda_trains_like_the_in_memory_engine(tmp_path: Path) -> None:
    """The parity scenario at world 1 on a GPU (the fixture's world of two cannot share one): pinned
    windows, side-stream gradient copies, shards copied in from host and disk. A tier whose optimizer
    steps off the device runs another Adam kernel than CUDA's: equal to the in-memory engine to rounding only."""
    (result,) = run_ranks(1, parity, str(tmp_path))
    losses = {key: torch.tensor(value) for key, value in result["losses"].items()}
    none = losses["none/fp32"]
    for tier in ("params_cpu", "params_nvme"):  # the device's own Adam: the same kernels
        assert torch.equal(losses[f"{tier}/fp32"], none), tier
    for tier in ("optimizer_cpu", "optimizer_nvme", "both_nvme"):
        assert torch.allclose(losses[f"{tier}/fp32"], none, rtol=1e-4, atol=1e-5), (tier, losses[f"{tier}/fp32"], none)
    # bf16: a master that differs in its last bit can round to another bf16 value.
    assert torch.allclose(losses["both_nvme/bf16"], losses["none/bf16"], rtol=1e-2, atol=1e-3)
    assert torch.equal(losses["whole_sub_group/fp32"], none)
    assert none[-1] < none[0]
    assert result["in_flight"] >= 2
    assert result["files"]["optimizer_nvme/fp32"] == ["exp_avg", "exp_avg_sq", "hp_params"]
    assert result["files"]["both_nvme/fp32"] == ["exp_avg", "exp_avg_sq", "hp_params", "lp_params"]
    assert set(result["homes"]["optimizer_nvme/fp32"]["optim_states"]) == {"nvme"}
    assert result["devices"]["optimizer_nvme/fp32"]["hp_params"] == {"meta"}
    assert result["reads"]["params_nvme/fp32"][0] > 0
    assert result["losses"]["branchy/params_nvme"] == result["losses"]["branchy/none"]
    assert result["left"] == []


# ---- 6: offload_states / reload_states with every tier ---------------------------------------------------
def parking(rank: int, world: int, root: str, park: str | None) -> dict:
    out: dict[str, Any] = {}
    for name, zero in tiers(root).items():
        engine, model = build(zero)
        batches = models.batches("tokens", STEPS, 4 * world)
        losses = train(engine, rank, world, batches[:2])
        before = local_state(engine, model)
        written_before = engine.parts.disk.bytes_written
        engine.offload_states(device="nvme", nvme_path=park or root)
        parked = engine.state_report()
        # 5: parking goes through the tiers' own disk layer and host pool, not a second one.
        shared = engine.offloader.disk is engine.parts.disk and engine.offloader.host.pool is engine.parts.host_pool
        parked_bytes = engine.parts.disk.bytes_written - written_before
        engine.reload_states()
        back = engine.state_report()
        out[name] = {
            "parked": dict(parked), "homes": parked.homes, "back": dict(back), "exact": same(before, local_state(engine, model)),
            "losses": losses + train(engine, rank, world, batches[2:]),
            "table": str(parked), "shared": shared, "parked_bytes": parked_bytes,
        }
        engine.destroy()
    return out


@ON_DEVICES
@pytest.mark.parametrize("park_at", ["own_path", "tier_path"])
def test_every_tier_parks_on_disk_and_comes_back_home_bit_exact(tmp_path: Path, park_at: str, device: str) -> None:
    # tier_path: parked beside the tier's own files (the default nvme_path), whose names they must not take.
    root, park = tmp_path / "tier", tmp_path / "park"
    root.mkdir()
    (result,) = run_ranks(1, parking, str(root), str(park) if park_at == "own_path" else None)
    for name, r in result.items():
        assert r["exact"], name
        if device == "cuda" and "offload_optimizer" in tiers(str(root))[name]:
            # The host's Adam, not CUDA's (as in test_offload_cuda): equal to the device engine to rounding.
            assert torch.allclose(torch.tensor(r["losses"]), torch.tensor(result["none"]["losses"]),
                                  rtol=1e-4, atol=1e-5), name
        else:
            assert r["losses"] == result["none"]["losses"], name
        for state in ("hp_params", "lp_params", "lp_grads", "optim_states"):
            assert set(r["parked"][state]) == {"nvme"}, (name, state, r["parked"][state])
            assert set(r["back"][state]) == set(r["homes"][state]), (name, state)  # back where the tier keeps it
        assert "home" in r["table"] and "now" in r["table"]
        assert r["shared"] and r["parked_bytes"] > 0, name  # one I/O layer: the tiers' disk wrote the parked states
    assert set(result["optimizer_nvme"]["back"]["hp_params"]) == {"nvme"}  # it never left its home
    assert set(result["optimizer_cpu"]["back"]["hp_params"]) == {"cpu"}


def reserved_vs_written(rank: int, world: int, root: str) -> dict:
    from zero3.offload.tiers import disk_needs

    engine, _ = build(tiers(root)["both_nvme"])  # max_in_cpu keeps some shards in host memory
    trainable = sum(sp.shard_numel for sp in engine.optimizer.params)
    states = 1 + len(engine.optimizer.state_names)  # the master and Adam's two moments
    needs = disk_needs(engine.config, engine.all_units, engine.compute_dtype, trainable, states)
    result = {
        "reserved": needs["zero_optimization.offload_param.nvme_path"][1],
        "file": engine.parts.param_disk.file.nbytes,
        "all_shards": sum(unit.shard_numel for unit in engine.all_units) * engine.compute_dtype.itemsize,
    }
    engine.destroy()
    return result


@ON_DEVICES
def test_the_free_space_check_asks_for_the_shards_that_go_to_disk_only(tmp_path: Path, device: str) -> None:
    (result,) = run_ranks(1, reserved_vs_written, str(tmp_path))
    assert result["reserved"] == result["file"] < result["all_shards"]


# ---- 7: bad input fails before training starts ------------------------------------------------------------
def bad_input(rank: int, world: int, root: str) -> dict:
    out: dict[str, str] = {}
    not_a_dir = Path(root) / "file"
    not_a_dir.write_text("x")
    cases = {
        "missing": {"offload_optimizer": {"device": "nvme", "nvme_path": str(Path(root) / "absent")}},
        "not_a_dir": {"offload_param": {"device": "nvme", "nvme_path": str(not_a_dir)}},
        "read_only": {"offload_param": {"device": "nvme", "nvme_path": "/proc"}},
    }
    for case, zero in cases.items():
        try:
            build(zero)
            out[case] = "no error"
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            out[case] = f"{type(error).__name__}: {error}"
    import shutil

    from zero3.offload import tiers as tier_module

    usage, real_disk_usage = shutil.disk_usage(root), shutil.disk_usage
    tier_module.shutil.disk_usage = lambda path: usage._replace(free=1000)  # type: ignore[attr-defined]
    try:
        build({"offload_param": {"device": "nvme", "nvme_path": root},
               "offload_optimizer": {"device": "nvme", "nvme_path": root}})
        out["no_space"] = "no error"
    except Exception as error:  # noqa: BLE001
        out["no_space"] = f"{type(error).__name__}: {error}"
    finally:
        tier_module.shutil.disk_usage = real_disk_usage  # type: ignore[attr-defined]
    out["left_after_no_space"] = ",".join(sorted(p.name for p in Path(root).iterdir()))

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("zero3").addHandler(Keep())
    engine, _ = build({"offload_optimizer": {"device": "cpu", "pin_memory": True}})
    engine.destroy()
    out["pin_warning"] = "\n".join(r for r in records if "pin_memory" in r)
    engine, _ = build({"offload_optimizer": {"device": "nvme", "nvme_path": root, "ratio": 0.5}})
    engine.destroy()
    out["ratio_warning"] = "\n".join(r for r in records if "ratio" in r)
    return out


def test_bad_tier_paths_and_too_little_space_fail_before_anything_is_written(tmp_path: Path) -> None:
    (out,) = run_ranks(1, bad_input, str(tmp_path))
    assert "zero_optimization.offload_optimizer.nvme_path=" in out["missing"] and "does not exist" in out["missing"]
    assert "zero_optimization.offload_param.nvme_path=" in out["not_a_dir"] and "not a directory" in out["not_a_dir"]
    assert "offload_param.nvme_path='/proc'" in out["read_only"] and "not writable" in out["read_only"]
    assert "too little free disk space" in out["no_space"], out["no_space"]
    assert "offload_param.nvme_path" in out["no_space"] and "offload_optimizer.nvme_path" in out["no_space"]
    assert out["left_after_no_space"] == "file"  # nothing was written
    assert "offload_optimizer.pin_memory=true has no effect" in out["pin_warning"]
    assert "offload_optimizer.ratio=0.5 has no effect on a CPU engine" in out["ratio_warning"]


# ---- 7: a disk that fails mid-step loses nothing ---------------------------------------------------------
def failing_disk(rank: int, world: int, root: str, zero_name: str) -> dict:
    zero = tiers(root)[zero_name]
    batches = models.batches("tokens", STEPS, 4 * world)
    engine, _ = build(zero)
    expected = train(engine, rank, world, batches)
    engine.destroy()

    engine, model = build(zero)
    losses = train(engine, rank, world, batches[:2])
    x, y = batches[2]
    x, y = x.chunk(world)[rank].to(engine.device), y.chunk(world)[rank].to(engine.device)
    loss = models.loss_of(engine(x, y), engine.module)
    engine.backward(loss)
    losses.append(loss.item())
    before = local_state(engine, model)
    write = disk_io._pwrite_all
    calls = {"n": 0}

    def failing(fd: int, data: memoryview, offset: int, path: Path) -> None:
        calls["n"] += 1
        # After 3 writes, a real EBADF from the real write (the OS names no file; the I/O layer adds it).
        write(fd if calls["n"] <= 3 else -1, data, offset, path)

    disk_io._pwrite_all = failing  # type: ignore[assignment]
    out: dict[str, Any] = {}
    try:
        engine.step()
        out["error"] = None
    except StepIOError as error:
        out["error"] = str(error)
        out["applied"] = error.step_applied
    finally:
        disk_io._pwrite_all = write  # type: ignore[assignment]
    out["steps_after_failure"] = engine.global_steps
    if out.get("applied") is False:
        out["state_kept"] = same(before, local_state(engine, model))
        engine.step()  # the retry, on a healthy disk
    losses += train(engine, rank, world, batches[3:])
    out["losses"], out["expected"] = losses, expected
    engine.destroy()
    return out


@ON_DEVICES
@pytest.mark.parametrize("tier", ["optimizer_nvme", "both_nvme"])
def test_a_disk_failing_mid_step_loses_nothing_and_the_step_can_be_retried(
    tmp_path: Path, tier: str, device: str
) -> None:
    (out,) = run_ranks(1, failing_disk, str(tmp_path), tier)
    # The OS's error, with the file it hit (pwrite names none; the I/O layer adds it).
    assert out["error"] is not None and "Bad file descriptor" in out["error"], out
    assert "zero3-rank0-" in out["error"], out["error"]
    assert out["applied"] is False and "not applied" in out["error"]
    assert out["steps_after_failure"] == 2
    assert out["state_kept"]  # masters, moments and 16-bit shards as before the step
    assert out["losses"] == out["expected"]


@ON_DEVICES
def test_a_failed_parameter_write_after_a_landed_step_is_repaired_from_the_masters(tmp_path: Path, device: str) -> None:
    (out,) = run_ranks(1, failing_disk, str(tmp_path), "params_nvme")
    assert out["error"] is not None and out["applied"] is True and "Do not repeat the step" in out["error"]
    assert "Bad file descriptor" in out["error"] and "zero3-rank0-" in out["error"], out["error"]  # the file
    assert out["steps_after_failure"] == 3
    assert out["losses"] == out["expected"]

