"""offload_states / reload_states / get_state_devices / state_report, at world size 2.

Each scenario runs once in spawned ranks (a module fixture) and the
parametrised tests read its per-case results, so 48 round-trip cases cost one
process launch.
"""

from __future__ import annotations

import itertools
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import zero3
from tests import models
from tests.devices import ON_DEVICES, cpu_ranks_or_one_gpu
from tests.distributed import run_ranks
from tests.logs import zero3_messages
from zero3 import OffloadStateType

WORLD = 2
STATES = list(OffloadStateType)
INCLUDES: list[OffloadStateType | None] = [*STATES, None]
ROUND_TRIP_CASES = list(itertools.product(["cpu", "nvme"], INCLUDES, [True, False], [False, True]))


def config(**extra: Any) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 64, **extra.pop("zero", {})}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": zero,
        **extra,
    }


def build(rank: int, world: int, **extra: Any) -> tuple[zero3.ZeroEngine, torch.nn.Module]:
    torch.manual_seed(0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=config(**extra))
    return engine, model


def micro_step(engine: zero3.ZeroEngine, batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> float:
    x, y = batch
    loss = engine(x.chunk(world)[rank].to(engine.device), y.chunk(world)[rank].to(engine.device))
    engine.backward(loss)
    return loss.item()


def snapshot(engine: zero3.ZeroEngine, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Clones of every per-rank state, through the public shard getters."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"{name}/lp"] = zero3.safe_get_local_lp_param(p).clone()
        out[f"{name}/hp"] = zero3.safe_get_local_fp32_param(p).clone()
        out[f"{name}/grad"] = zero3.safe_get_local_grad(p).clone()
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{moment}"] = zero3.safe_get_local_optimizer_state(p, moment).clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def devices(engine: zero3.ZeroEngine) -> dict[str, set[str]]:
    return {s.value: {str(d) for d in zero3.get_state_devices(engine, s)} for s in STATES}


def files_under(root: str) -> list[str]:
    """This rank's files under the disk tier's root (the ranks share the root, each has its own folder)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return sorted(str(p.relative_to(root)) for p in Path(root).glob(f"zero3-rank{rank}-*/*") if p.is_file())


def guarded(results: dict, key: Any, fn: Any, *args: Any) -> None:
    """Run one case; a failure is recorded for its test rather than ending the scenario."""
    try:
        results[key] = fn(*args)
    except Exception:  # noqa: BLE001 - reported by the case's test
        results[key] = {"error": traceback.format_exc()}


def case_result(results: list[dict], key: Any) -> list[dict]:
    per_rank = [r[key] for r in results]
    for r in per_rank:
        assert "error" not in r, r["error"]
    return per_rank


# ---- the reference round trip ---------------------------------------------------------------
def round_trips(rank: int, world: int, root: str) -> dict:
    engine, model = build(rank, world)
    data = models.batches("x8", 3 + len(ROUND_TRIP_CASES), 4 * world)
    for batch in data[:3]:
        micro_step(engine, batch, rank, world)
        engine.step()
    results: dict = {}

    def one(case: tuple, batch: tuple) -> dict:
        device, include, pin, non_blocking = case
        micro_step(engine, batch, rank, world)  # leaves reduced gradients in lp_grads
        before = snapshot(engine, model)
        chosen = STATES if include is None else [include]
        engine.offload_states(
            include=None if include is None else [include], device=device, pin_memory=pin,
            non_blocking=non_blocking, nvme_path=root,
        )
        offloaded = devices(engine)
        report = dict(engine.state_report())
        on_disk = files_under(root)
        statuses = {str(zero3.param_status(p)) for p in model.parameters()}
        engine.reload_states(non_blocking=non_blocking)
        after = snapshot(engine, model)
        result = {
            "chosen": [s.value for s in chosen], "offloaded": offloaded, "reloaded": devices(engine),
            "equal": same(before, after), "nonzero_grads": any(v.abs().sum() > 0 for k, v in before.items() if k.endswith("grad")),
            "report": report, "files": on_disk, "files_after": files_under(root), "statuses": statuses,
        }
        engine.step()
        return result

    for case, batch in zip(ROUND_TRIP_CASES, data[3:]):
        guarded(results, case, one, case, batch)
    engine.destroy()
    results["files_after_destroy"] = files_under(root)
    results["folders_after_destroy"] = list(Path(root).glob(f"zero3-rank{rank}-*"))
    return results


@pytest.fixture(scope="module")
def round_trip_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(WORLD, round_trips, str(tmp_path_factory.mktemp("nvme")))


@pytest.mark.parametrize("device,include,pin_memory,non_blocking", ROUND_TRIP_CASES)
def test_offload_then_reload_is_bit_exact_and_devices_follow(
    round_trip_results: list[dict], device: str, include: OffloadStateType | None, pin_memory: bool,
    non_blocking: bool,
) -> None:
    for result in case_result(round_trip_results, (device, include, pin_memory, non_blocking)):
        assert result["equal"], "a state changed across offload/reload"
        assert result["nonzero_grads"], "the test must round-trip real gradients"
        for state in STATES:
            moved = state.value in result["chosen"]
            if state is OffloadStateType.contiguous_grad_buffer:
                # Offloading the scratch bucket frees it; reload recreates it.
                assert result["offloaded"][state.value] == (set() if moved else {"cpu"})
                assert (result["report"][state.value] == {}) == moved
            elif moved and device == "nvme":
                assert result["offloaded"][state.value] == {"meta"}
                assert set(result["report"][state.value]) == {"nvme"}
            else:
                # A CPU engine's states already live in host memory: device "cpu" moves nothing.
                assert result["offloaded"][state.value] == {"cpu"}
            assert result["reloaded"][state.value] == {"cpu"}
        # Before anything moves, gathered parameters (persistent ones too, with lp_params) are released.
        if device == "nvme" and include in (None, OffloadStateType.lp_params):
            assert result["statuses"] == {"ParamStatus.NOT_AVAILABLE"}
        data_states = [s for s in result["chosen"] if s != "contiguous_grad_buffer"]
        if device == "nvme" and data_states:
            assert result["files"], "disk offload wrote no file"
        else:
            assert result["files"] == []
        assert result["files_after"] == [], "files must be removed after reload"


def test_destroy_leaves_no_files(round_trip_results: list[dict]) -> None:
    for result in round_trip_results:
        assert result["files_after_destroy"] == [] and result["folders_after_destroy"] == []


# ---- offload between every step keeps training exact --------------------------------------------
def loss_sequences(rank: int, world: int, root: str, offload: bool) -> list[float]:
    engine, _ = build(rank, world, gradient_accumulation_steps=2)
    losses = []
    cycle = itertools.cycle([("nvme", False), ("cpu", False), ("nvme", True), ("cpu", True)])
    for index, batch in enumerate(models.batches("x8", 12, 4 * world)):
        losses.append(micro_step(engine, batch, rank, world))
        if offload:  # mid-accumulation on odd micro-steps, after the step on even ones
            device, non_blocking = next(cycle)
            engine.offload_states(device=device, non_blocking=non_blocking, nvme_path=root)
            engine.reload_states(non_blocking=non_blocking)
        engine.step()
        if offload and index % 2 == 1:
            engine.offload_states(include=["optim_states", "hp_params"], device="nvme", nvme_path=root)
            engine.reload_states()
    engine.destroy()
    return losses


@cpu_ranks_or_one_gpu(WORLD)
def test_offloading_between_every_step_gives_the_same_losses(tmp_path: Path, world: int, device: str) -> None:
    # On CUDA device "cpu" moves the states to (pinned) host memory and back, mid-accumulation too.
    plain = run_ranks(world, loss_sequences, str(tmp_path), False)
    offloaded = run_ranks(world, loss_sequences, str(tmp_path), True)
    assert plain == offloaded
    assert len(set(plain[0])) > 1


# ---- resident memory drops on disk offload ---------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(1024, 5120)
        self.down = torch.nn.Linear(5120, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).pow(2).mean()


def resident_memory(rank: int, world: int, root: str, non_blocking: bool) -> dict:
    cfg = config(zero={"stage3_param_persistence_threshold": 0})
    del cfg["bf16"]  # fp32: 4 bytes per element in every state
    torch.manual_seed(0)
    model = Wide()
    engine, *_ = zero3.initialize(model=model, config=cfg)
    x = torch.randn(8, 1024)
    engine.backward(engine(x))
    engine.step()
    engine.backward(engine(x))
    report = engine.state_report()
    offloaded = sum(sum(places.values()) for places in report.values())
    # The scratch bucket comes back as untouched (not yet resident) memory, filled by the next backward.
    data_bytes = offloaded - sum(report["contiguous_grad_buffer"].values())
    resident = _rss()
    engine.offload_states(device="nvme", nvme_path=root, non_blocking=non_blocking)
    zero3.get_state_devices(engine, "lp_params")  # waits for background writes
    after_offload = _rss()
    engine.reload_states(non_blocking=non_blocking)
    engine.step()  # any use waits for the reads
    after_reload = _rss()
    result = {"offloaded": offloaded, "data_bytes": data_bytes, "drop": resident - after_offload,
              "rise": after_reload - after_offload}
    engine.backward(engine(x))  # and training goes on
    engine.step()
    engine.destroy()
    return result


@pytest.mark.parametrize("non_blocking", [False, True])
def test_disk_offload_releases_resident_memory(tmp_path: Path, non_blocking: bool) -> None:
    for result in run_ranks(WORLD, resident_memory, str(tmp_path), non_blocking):
        assert result["offloaded"] >= 100 * 2**20, "the model's states must be 100+ MB"
        assert result["drop"] >= 0.8 * result["offloaded"], result
        assert result["rise"] >= 0.8 * result["data_bytes"], result


def released_on_return(rank: int, world: int, root: str) -> dict:
    """20 blocking offloads to disk: when the call returns, the parked buffers' memory is free (no I/O
    thread still holds a view of it), and a scratch bucket that never existed is not made by reload."""
    engine, model = build(rank, world, zero={"stage3_param_persistence_threshold": 0})
    scratch_before = engine.model_state_bytes()["contiguous_grad_buffer"]  # no backward yet: none
    engine.offload_states(device="nvme", nvme_path=root)
    engine.reload_states()
    scratch_after = engine.model_state_bytes()["contiguous_grad_buffer"]
    late = 0
    for _ in range(20):
        # Each buffer's storage, held here only: once the call returns, nothing else may hold it.
        held = [buffer.tensor.untyped_storage() for buffer in engine.parts.state_buffers(OffloadStateType.optim_states)]
        engine.offload_states(include=[OffloadStateType.optim_states], device="nvme", nvme_path=root)
        late += sum(torch._C._storage_Use_Count(storage._cdata) > 1 for storage in held)
        del held
        engine.reload_states()
    engine.destroy()
    return {"scratch": (scratch_before, scratch_after), "late": late}


@ON_DEVICES
def test_a_disk_offload_frees_memory_before_it_returns_and_reload_makes_no_new_bucket(
    tmp_path: Path, device: str
) -> None:
    (result,) = run_ranks(1, released_on_return, str(tmp_path))
    assert result["scratch"] == (0, 0)
    assert result["late"] == 0


def bare_gradients(rank: int, world: int, root: str) -> dict:
    """At 2 CPU ranks the gradient shards are made by the backward and dropped at the step: between steps
    lp_grads holds no bytes, yet it has a place, and offloading it is an offload like any other."""
    engine, model = build(rank, world)
    data = models.batches("x8", 3, 4 * world)
    micro_step(engine, data[0], rank, world)
    engine.step()
    seen: dict = {"between_steps": devices(engine)["lp_grads"], "bytes": engine.model_state_bytes()["lp_grads"],
                  "report": dict(engine.state_report())["lp_grads"]}
    for target in ("nvme", "cpu"):
        engine.offload_states(include=["lp_grads"], device=target, nvme_path=root)
        seen[target] = {"devices": devices(engine)["lp_grads"], "report": dict(engine.state_report())["lp_grads"]}
        try:
            micro_step(engine, data[1], rank, world)
            seen[target]["backward"] = "ran"
        except zero3.StateOffloadedError as error:
            seen[target]["backward"] = str(error)
        engine.reload_states()
        seen[target]["back"] = devices(engine)["lp_grads"]
    micro_step(engine, data[2], rank, world)
    engine.step()  # training goes on
    engine.destroy()
    return seen


def test_gradients_made_on_demand_live_on_their_device_between_steps_and_offload_like_any_state(
    tmp_path: Path,
) -> None:
    for seen in run_ranks(WORLD, bare_gradients, str(tmp_path)):
        assert seen["bytes"] == 0, seen  # made on demand: none between steps
        assert seen["between_steps"] == {"cpu"} and seen["report"] == {"cpu": 0}, seen
        assert seen["nvme"]["devices"] == {"meta"} and seen["nvme"]["report"] == {"nvme": 0}, seen
        assert "lp_grads" in seen["nvme"]["backward"] and "reload_states" in seen["nvme"]["backward"], seen
        # Offloading to the host on a CPU engine moves nothing and leaves it in place (as for every state).
        assert seen["cpu"]["devices"] == {"cpu"} and seen["cpu"]["backward"] == "ran", seen
        assert seen["nvme"]["back"] == seen["cpu"]["back"] == {"cpu"}, seen


# ---- misuse ------------------------------------------------------------------------------------
def _limit_file_size(limit: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


def misuse(rank: int, world: int, root: str) -> dict:
    import logging

    import zero3.offload.disk as disk

    records = zero3_messages()
    logging.getLogger("zero3").setLevel(logging.INFO)

    engine, model = build(rank, world)
    data = models.batches("x8", 4, 4 * world)
    for batch in data[:2]:
        micro_step(engine, batch, rank, world)
        engine.step()
    micro_step(engine, data[2], rank, world)
    results: dict = {}

    def unchanged(before: dict) -> bool:
        return same(before, snapshot(engine, model)) and devices(engine) == {s.value: {"cpu"} for s in STATES}

    def twice() -> dict:
        engine.offload_states(include=["lp_grads", "contiguous_grad_buffer"], device="nvme", nvme_path=root)
        first = (devices(engine), files_under(root))
        engine.offload_states(include=["lp_grads", "contiguous_grad_buffer"], device="nvme", nvme_path=root)
        second = (devices(engine), files_under(root))
        engine.reload_states()
        return {"same": first == second, "parked": first[0]["lp_grads"] == {"meta"}}

    def reload_nothing() -> dict:
        before = snapshot(engine, model)
        del records[:]
        engine.reload_states()
        return {"unchanged": unchanged(before), "said": any("nothing is offloaded" in m for m in records)}

    def bad_arguments() -> dict:
        before = snapshot(engine, model)
        messages = []
        for kwargs in (
            {"include": ["hp_params", "gradients"]}, {"include": 7}, {"device": "gpu"}, {"device": "none"},
            {"device": "nvme", "nvme_path": None},
        ):
            with pytest.raises(ValueError) as error:
                engine.offload_states(**kwargs)
            messages.append(str(error.value))
        with pytest.raises(ValueError, match="unknown state 'grads'"):
            zero3.get_state_devices(engine, "grads")
        return {"unchanged": unchanged(before) and files_under(root) == [], "messages": messages}

    def use_while_offloaded() -> dict:
        before = snapshot(engine, model)
        counters = (engine.micro_steps, engine.global_steps)
        x, y = (t.chunk(world)[rank] for t in data[3])
        errors = {}
        shard = zero3.safe_get_local_lp_param(model.fc1.weight).clone()
        engine.offload_states(include=["lp_params"], device="nvme", nvme_path=root)
        with pytest.raises(zero3.StateOffloadedError) as error:
            engine(x, y)
        errors["forward"] = str(error.value)
        # DeepSpeed's getters read a parked state from its file (a copy); its setters refuse it.
        errors["getter_reads"] = torch.equal(zero3.safe_get_local_lp_param(model.fc1.weight), shard)
        with pytest.raises(zero3.StateOffloadedError) as error:
            zero3.safe_set_local_fp32_param(model.fc1.weight, shard.float())
        errors["setter"] = str(error.value)
        engine.reload_states()
        loss = engine(x, y)  # the graph exists before the gradient buffers go
        engine.offload_states(include=["lp_grads", "contiguous_grad_buffer"], device="nvme", nvme_path=root)
        with pytest.raises(zero3.StateOffloadedError) as error:
            engine.backward(loss)
        errors["backward"] = str(error.value)
        engine.reload_states()
        engine.offload_states(include=["optim_states", "hp_params"], device="nvme", nvme_path=root)
        with pytest.raises(zero3.StateOffloadedError) as error:
            engine.step()
        errors["step"] = str(error.value)
        engine.reload_states()
        return {"errors": errors, "unchanged": unchanged(before),
                "counters": (engine.micro_steps, engine.global_steps) == counters}

    def disk_full(non_blocking: bool) -> dict:
        before = snapshot(engine, model)
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        _limit_file_size(1024)  # smaller than any state: the disk is "full"
        try:
            with pytest.raises(zero3.OffloadIOError) as error:
                engine.offload_states(device="nvme", nvme_path=root, non_blocking=non_blocking)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        return {"unchanged": unchanged(before), "no_files": files_under(root) == [], "message": str(error.value)}

    def not_writable() -> dict:
        before = snapshot(engine, model)
        blocker = Path(root) / f"a-file-{rank}"
        blocker.write_text("not a directory")
        with pytest.raises(zero3.OffloadIOError) as error:
            engine.offload_states(device="nvme", nvme_path=str(blocker / "sub"))
        blocker.unlink()
        return {"unchanged": unchanged(before), "message": str(error.value)}

    def failing_write(non_blocking: bool) -> dict:
        before = snapshot(engine, model)
        real = disk._pwrite_all
        calls = []

        def flaky(fd: int, data: memoryview, offset: int, path: Path) -> None:
            calls.append(offset)
            if len(calls) == 2:
                raise OSError(5, "Input/output error (injected)")
            real(fd, data, offset, path)

        disk._pwrite_all = flaky
        try:
            if non_blocking:
                engine.offload_states(device="nvme", nvme_path=root, non_blocking=True)
                with pytest.raises(zero3.OffloadIOError) as error:
                    engine.reload_states()
            else:
                with pytest.raises(zero3.OffloadIOError) as error:
                    engine.offload_states(device="nvme", nvme_path=root)
        finally:
            disk._pwrite_all = real
        return {"unchanged": unchanged(before), "no_files": files_under(root) == [], "message": str(error.value)}

    def failing_read() -> dict:
        before = snapshot(engine, model)
        real = disk._pread_all

        def broken(fd: int, into: memoryview, offset: int, path: Path) -> None:
            raise OSError(5, "Input/output error (injected)")

        engine.offload_states(include=["optim_states"], device="nvme", nvme_path=root)
        disk._pread_all = broken
        try:
            with pytest.raises(zero3.OffloadIOError) as error:
                engine.reload_states()
        finally:
            disk._pread_all = real
        still_parked = devices(engine)["optim_states"] == {"meta"}
        kept = len(files_under(root)) == 2
        engine.reload_states()
        return {"unchanged": unchanged(before), "still_parked": still_parked, "kept": kept, "message": str(error.value)}

    def inside_gathered() -> dict:
        with zero3.GatheredParameters([model.fc1.weight]):
            with pytest.raises(RuntimeError, match="inside GatheredParameters") as error:
                engine.offload_states()
        return {"message": str(error.value)}

    def prefetch_released() -> dict:
        x, y = (t.chunk(world)[rank] for t in data[3])
        with torch.no_grad():
            engine(x, y)  # a traced forward: prefetches follow the last order
        engine.offload_states(include=["hp_params"], device="nvme", nvme_path=root)
        statuses = {str(zero3.param_status(p)) for n, p in model.named_parameters() if "weight" in n}
        engine.reload_states()
        return {"statuses": statuses}

    def cpu_engine_says_no_op() -> dict:
        del records[:]
        engine.offload_states(include=["hp_params", "optim_states"], device="cpu")
        engine.reload_states()
        return {"said": [m for m in records if "nothing to move" in m]}

    def report_table() -> dict:
        engine.offload_states(include=["optim_states", "contiguous_grad_buffer"], device="nvme", nvme_path=root)
        report = engine.state_report()
        text = str(report)
        engine.reload_states()
        return {"report": dict(report), "text": text, "expected": 2 * engine.optimizer.hp_params.nbytes}

    for name, fn, args in [
        ("twice", twice, ()), ("reload_nothing", reload_nothing, ()), ("bad_arguments", bad_arguments, ()),
        ("use_while_offloaded", use_while_offloaded, ()), ("disk_full", disk_full, (False,)),
        ("disk_full_non_blocking", disk_full, (True,)), ("not_writable", not_writable, ()),
        ("failing_write", failing_write, (False,)), ("failing_write_non_blocking", failing_write, (True,)),
        ("failing_read", failing_read, ()), ("inside_gathered", inside_gathered, ()),
        ("prefetch_released", prefetch_released, ()), ("cpu_engine_says_no_op", cpu_engine_says_no_op, ()),
        ("report_table", report_table, ()),
    ]:
        guarded(results, name, fn, *args)
    # Training goes on normally after every misuse above.
    engine.step()
    micro_step(engine, data[3], rank, world)
    engine.step()
    results["trains_after"] = True
    engine.destroy()
    return results


@pytest.fixture(scope="module")
def misuse_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(WORLD, misuse, str(tmp_path_factory.mktemp("misuse")))


def test_offloading_an_offloaded_state_is_a_no_op(misuse_results: list[dict]) -> None:
    for r in case_result(misuse_results, "twice"):
        assert r["same"] and r["parked"]


def test_reload_with_nothing_offloaded_is_a_no_op(misuse_results: list[dict]) -> None:
    for r in case_result(misuse_results, "reload_nothing"):
        assert r["unchanged"] and r["said"]


def test_unknown_state_or_device_is_a_value_error_before_anything_moves(misuse_results: list[dict]) -> None:
    for r in case_result(misuse_results, "bad_arguments"):
        assert r["unchanged"]
        unknown_state, not_a_collection, gpu, none, no_path = r["messages"]
        assert "'gradients'" in unknown_state and "optim_states" in unknown_state
        assert "int" in not_a_collection
        assert "'gpu'" in gpu and "'nvme'" in gpu
        assert "'none'" in none
        assert "nvme_path" in no_path


def test_forward_backward_step_refuse_to_run_on_offloaded_states(misuse_results: list[dict]) -> None:
    for r in case_result(misuse_results, "use_while_offloaded"):
        assert r["unchanged"] and r["counters"]
        errors = r["errors"]
        assert "forward" in errors["forward"] and "lp_params" in errors["forward"]
        assert errors["getter_reads"] and "reload_states" in errors["setter"]
        assert "lp_grads" in errors["backward"] and "contiguous_grad_buffer" in errors["backward"]
        assert "hp_params" in errors["step"] and "optim_states" in errors["step"]


@pytest.mark.parametrize("case", ["disk_full", "disk_full_non_blocking", "not_writable"])
def test_a_full_or_unwritable_disk_fails_before_anything_moves(misuse_results: list[dict], case: str) -> None:
    for r in case_result(misuse_results, case):
        assert r["unchanged"], "every state must stay where it was, intact"
        assert r.get("no_files", True)
        assert "Nothing was moved" in r["message"]


@pytest.mark.parametrize("case", ["failing_write", "failing_write_non_blocking"])
def test_a_failed_write_keeps_every_state_in_memory(misuse_results: list[dict], case: str) -> None:
    for r in case_result(misuse_results, case):
        assert r["unchanged"] and r["no_files"]
        assert "injected" in r["message"] and "nothing was lost" in r["message"]


def test_a_failed_read_leaves_the_state_on_disk_for_a_retry(misuse_results: list[dict]) -> None:
    for r in case_result(misuse_results, "failing_read"):
        assert r["still_parked"] and r["kept"] and r["unchanged"]
        assert "injected" in r["message"] and "stays offloaded" in r["message"]


def test_offload_inside_gathered_parameters_is_refused(misuse_results: list[dict]) -> None:
    for r in case_result(misuse_results, "inside_gathered"):
        assert "fc1" in r["message"]


def test_offload_releases_gathered_parameters_and_prefetches(misuse_results: list[dict]) -> None:
    for r in case_result(misuse_results, "prefetch_released"):
        assert r["statuses"] == {"ParamStatus.NOT_AVAILABLE"}


def test_cpu_offload_on_a_cpu_engine_says_it_is_a_no_op(misuse_results: list[dict]) -> None:
    for r in case_result(misuse_results, "cpu_engine_says_no_op"):
        assert len(r["said"]) == 1 and "hp_params, optim_states" in r["said"][0]


def test_state_report_gives_devices_and_bytes_and_prints_a_table(misuse_results: list[dict]) -> None:
    for r in case_result(misuse_results, "report_table"):
        report = r["report"]
        assert set(report) == {s.value for s in STATES}
        assert report["optim_states"] == {"nvme": r["expected"]}
        assert report["contiguous_grad_buffer"] == {}
        assert set(report["lp_params"]) == {"cpu"} and report["lp_params"]["cpu"] > 0
        assert "optim_states" in r["text"] and "nvme" in r["text"] and "(freed)" in r["text"]


def test_training_continues_after_every_misuse(misuse_results: list[dict]) -> None:
    assert all(r["trains_after"] for r in misuse_results)
