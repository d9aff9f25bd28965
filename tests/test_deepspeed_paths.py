"""`import zero3.deepspeed as deepspeed`: DeepSpeed's module paths, each bound to zero3's own object.

Every path the DeepSpeed switch names imports and is zero3's; nothing poses as the `deepspeed` package; a
DeepSpeed-style training script (its import line the only change) trains at 2 ranks as the same script on
zero3's own names does; the accelerator, comm, the optimizers and activation checkpointing behave as
DeepSpeed's do, checked against plain PyTorch.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zero3
from tests.distributed import run_ranks, script_env

# (module path, name): what DeepSpeed scripts import, and the zero3 object it must be (None: zero3.deepspeed's own).
PATHS = [
    ("", "initialize", None), ("", "init_distributed", zero3.init_distributed), ("", "add_config_arguments", None),
    ("", "DeepSpeedEngine", zero3.ZeroEngine),
    ("zero", "Init", zero3.Init), ("zero", "GatheredParameters", zero3.GatheredParameters),
    ("zero", "register_external_parameter", zero3.register_external_parameter), ("zero", "MiCS_Init", zero3.MiCS_Init),
    ("runtime.zero", "Init", zero3.Init),
    ("runtime.zero.partition_parameters", "Init", zero3.Init),
    ("runtime.zero.partition_parameters", "GatheredParameters", zero3.GatheredParameters),
    ("runtime.zero.partition_parameters", "ZeroParamStatus", zero3.ZeroParamStatus),
    ("runtime.zero.offload_config", "OffloadDeviceEnum", zero3.OffloadDevice),
    ("runtime.zero.offload_config", "OffloadStateTypeEnum", zero3.OffloadStateType),
    ("runtime.zero.offload_states", "get_state_devices", zero3.get_state_devices),
    ("runtime.lr_schedules", "WarmupLR", None), ("runtime.lr_schedules", "WarmupDecayLR", None),
    ("runtime.lr_schedules", "OneCycle", None), ("runtime.lr_schedules", "WarmupCosineLR", None),
    ("comm", "get_rank", None), ("comm", "get_world_size", None), ("comm", "get_local_rank", None),
    ("comm", "barrier", None), ("comm", "all_reduce", None), ("comm", "broadcast", None), ("comm", "all_gather", None),
    ("comm", "is_initialized", None), ("comm", "init_distributed", zero3.init_distributed),
    ("accelerator", "get_accelerator", None),
    ("utils", "safe_get_full_fp32_param", zero3.safe_get_full_fp32_param),
    ("utils", "safe_get_local_fp32_param", zero3.safe_get_local_fp32_param),
    ("utils", "safe_get_full_grad", zero3.safe_get_full_grad),
    ("utils", "safe_get_local_optimizer_state", zero3.safe_get_local_optimizer_state),
    ("utils", "safe_set_full_fp32_param", zero3.safe_set_full_fp32_param),
    ("utils", "set_z3_leaf_modules", zero3.set_z3_leaf_modules), ("utils", "z3_leaf_module", zero3.z3_leaf_module),
    ("utils", "logger", None), ("utils", "log_dist", None),
    ("utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint", None),
    ("utils.zero_to_fp32", "convert_zero_checkpoint_to_fp32_state_dict", None),
    ("utils.zero_to_fp32", "load_state_dict_from_zero_checkpoint", None),
    ("ops.adam", "FusedAdam", None), ("ops.adam", "DeepSpeedCPUAdam", None), ("ops.lion", "FusedLion", None),
    ("checkpointing", "configure", None), ("checkpointing", "checkpoint", None),
    ("checkpointing", "is_configured", None), ("checkpointing", "reset", None),
    ("checkpointing", "model_parallel_cuda_manual_seed", None), ("checkpointing", "get_cuda_rng_tracker", None),
]


@pytest.mark.parametrize("module,name,expected", PATHS, ids=[f"{m or 'deepspeed'}.{n}" for m, n, _ in PATHS])
def test_every_deepspeed_path_imports_and_is_zero3s(module: str, name: str, expected: object) -> None:
    path = "zero3.deepspeed" + (f".{module}" if module else "")
    found = getattr(importlib.import_module(path), name)  # `from deepspeed.x import name`
    import zero3.deepspeed as deepspeed

    reached = deepspeed
    for part in filter(None, module.split(".")):
        reached = getattr(reached, part)  # `deepspeed.x.name`
    assert getattr(reached, name) is found
    if expected is not None:
        assert found is expected
    posing = sys.modules.get("deepspeed")  # DeepSpeed itself may be imported (the test extra installs it)
    assert posing is None or "zero3" not in str(getattr(posing, "__file__", "")), posing


def test_nothing_poses_as_the_deepspeed_package() -> None:
    """In a fresh interpreter: every path of zero3.deepspeed imported, and no `deepspeed` in sys.modules."""
    modules = sorted({f"zero3.deepspeed.{m}" if m else "zero3.deepspeed" for m, _, _ in PATHS})
    script = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('deepspeed' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=script_env(str(Path(__file__).resolve().parents[1])))
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr


def test_add_config_arguments_takes_deepspeeds_flags(tmp_path) -> None:
    import zero3.deepspeed as deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json")])
    assert args.deepspeed and args.deepspeed_config == str(tmp_path / "ds.json")


def test_the_accelerator_answers_for_the_cpu() -> None:
    from zero3.deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    assert accel.device_name() == "cpu" and accel.current_device_name() == "cpu"
    assert accel.is_available() and accel.communication_backend_name() == "gloo"
    assert accel.memory_allocated() > 0 and accel.max_memory_allocated() >= accel.memory_allocated()
    assert accel.is_bf16_supported() == zero3.accelerator.computes_bf16_natively(torch.device("cpu"))
    accel.manual_seed(5)
    a = torch.rand(3)
    accel.manual_seed(5)
    assert torch.equal(a, torch.rand(3))
    stream = accel.Stream()
    with accel.stream(stream):
        event = accel.Event()
        event.record()
    event.synchronize()
    accel.synchronize()
    accel.empty_cache()
    assert accel.on_accelerator(torch.zeros(1)) and not accel.is_pinned(torch.zeros(1))


def test_comm_refuses_before_a_process_group_exists() -> None:
    import zero3.deepspeed as deepspeed

    if torch.distributed.is_initialized():
        pytest.skip("this process already has a default group")
    assert not deepspeed.comm.is_initialized()
    with pytest.raises(RuntimeError, match="init_distributed"):
        deepspeed.comm.get_rank()


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_is_adamw_or_adam_as_adam_w_mode_says(adam_w_mode: bool) -> None:
    from zero3.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    def trained(make: type) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        optimizer = make(model.parameters())
        for _ in range(3):
            model(torch.randn(2, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return model.weight.detach().clone()

    reference = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    expected = trained(lambda params: reference(params, lr=1e-2, weight_decay=0.1))
    got = trained(lambda params: FusedAdam(params, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode))
    cpu = trained(lambda params: DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1, adamw_mode=adam_w_mode))
    assert torch.allclose(got, expected, atol=1e-6) and torch.allclose(cpu, expected, atol=1e-6)
    with pytest.raises(NotImplementedError, match="bias_correction"):
        FusedAdam(nn.Linear(2, 2).parameters(), bias_correction=False)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.relu(self.up(x))))


class Net(nn.Module):
    """A DeepSpeed script's model: blocks run through `deepspeed.checkpointing.checkpoint` when asked."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(16, 4)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        import zero3.deepspeed as deepspeed

        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if self.checkpointed else block(x)
        return nn.functional.cross_entropy(self.head(x), y)


def deepspeed_script(rank: int, world: int, ds_config: dict, checkpointed: bool, api: str) -> dict:
    """A DeepSpeed training script; `api` "deepspeed" is it with its import line changed, "zero3" the same
    loop on zero3's own names (the reference)."""
    if api == "deepspeed":
        import zero3.deepspeed as deepspeed
        from zero3.deepspeed.accelerator import get_accelerator

        deepspeed.init_distributed()
        device = get_accelerator().device_name()
        get_accelerator().manual_seed(0)
        deepspeed.checkpointing.model_parallel_cuda_manual_seed(0)
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = Net(checkpointed)
        optimizer = deepspeed.ops.adam.FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        rank_seen, world_seen = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
        full = deepspeed.utils.safe_get_full_fp32_param
    else:
        device = "cpu"
        torch.manual_seed(0)
        with zero3.Init(config=ds_config):
            model = Net(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
        engine, *_ = zero3.initialize(model=model, optimizer=optimizer, config=ds_config)
        rank_seen, world_seen = rank, world
        full = zero3.safe_get_full_fp32_param
    data = torch.Generator().manual_seed(1)
    losses, flat_buffer = [], []
    for _ in range(4):
        x = torch.randn(2 * world, 16, generator=data)
        y = torch.randint(0, 4, (2 * world,), generator=data)
        loss = engine(x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device))
        engine.backward(loss)
        if api == "deepspeed":  # DeepSpeed's names for the gradient shards, beside zero3's getter
            shards = torch.cat([zero3.safe_get_local_grad(sp.param).reshape(-1) for sp in engine.optimizer.params])
            averaged = torch.cat([g.reshape(-1) for _, grads in sorted(engine.optimizer.averaged_gradients.items())
                                  for g in grads])
            partitions = engine.optimizer.get_fp32_grad_partitions()
            fp32 = torch.cat([g.reshape(-1) for _, by_piece in sorted(partitions.items())
                              for _, g in sorted(by_piece.items())])
            flat_buffer.append((engine.optimizer.grad_partitions_flat_buffer.clone(), shards, averaged, fp32))
        engine.step()
        losses.append(loss.item())
    after_step = None
    if api == "deepspeed":
        after_step = (engine.optimizer.grad_partitions_flat_buffer.clone(), engine.optimizer.averaged_gradients)
    params = {name: full(p).clone() for name, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "rank": rank_seen, "world": world_seen, "flat_buffer": flat_buffer,
            "after_step": after_step}


CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def test_a_deepspeed_script_with_only_its_import_changed_trains_as_zero3_does() -> None:
    """The checkpointed blocks recompute under zero3's hooks (their parameters gathered again, their dropout
    drawing what the forward drew), so the ported script's losses and masters equal the plain zero3 loop's,
    bit for bit."""
    config = CONFIG | {"activation_checkpointing": {"cpu_checkpointing": True}}
    ported = run_ranks(2, deepspeed_script, config, True, "deepspeed")
    plain = run_ranks(2, deepspeed_script, CONFIG, False, "zero3")
    for rank, (a, b) in enumerate(zip(ported, plain)):
        assert (a["rank"], a["world"]) == (rank, 2)
        assert a["losses"] == b["losses"], (a["losses"], b["losses"])
        assert all(torch.equal(a["params"][name], b["params"][name]) for name in b["params"])
        for flat, shards, averaged, fp32 in a["flat_buffer"]:  # between backward and step: this rank's shards
            assert torch.equal(flat, shards) and flat.abs().sum() > 0
            assert torch.equal(averaged, shards) and torch.equal(fp32, shards)
        flat, averaged = a["after_step"]
        assert not flat.any() and averaged == {}  # the step consumed them


def test_activation_checkpointing_refuses_model_parallel_settings_before_building() -> None:
    from zero3 import activation_checkpointing

    with pytest.raises(NotImplementedError, match="partition_activations"):
        activation_checkpointing.configure(deepspeed_config={"activation_checkpointing": {
            "partition_activations": True}})
    activation_checkpointing.configure(deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    assert activation_checkpointing.is_configured()


def test_the_rng_tracker_forks_a_named_state_and_puts_the_default_back() -> None:
    from zero3.deepspeed import checkpointing

    checkpointing.model_parallel_cuda_manual_seed(3)
    tracker = checkpointing.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    torch.manual_seed(3 + 2718)
    assert torch.equal(inside, torch.rand(4))  # the model-parallel state is seed + 2718, Megatron's
    with pytest.raises(ValueError, match="already"):
        tracker.add("model-parallel-rng", 99)


def train_and_save(rank: int, world: int, directory: str) -> dict:
    from zero3.deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    torch.manual_seed(0)
    model = Net(False)
    engine, *_ = zero3.initialize(model=model, config=CONFIG | {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    x, y = torch.randn(2, 16), torch.randint(0, 4, (2,))
    engine.backward(engine(x, y))
    engine.step()
    engine.save_checkpoint(directory)
    try:
        load_state_dict_from_zero_checkpoint(engine.module, directory)
        refusal = ""
    except ValueError as error:
        refusal = str(error)
    with zero3.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
        inside = load_state_dict_from_zero_checkpoint(engine.module, directory) is engine.module
    params = {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}
    engine.destroy()
    return {"params": params, "refusal": refusal, "inside": inside}


def test_load_state_dict_from_zero_checkpoint_fills_a_plain_model_and_refuses_a_partitioned_one(tmp_path) -> None:
    from zero3.deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    results = run_ranks(2, train_and_save, str(tmp_path))
    plain = Net(False)
    assert load_state_dict_from_zero_checkpoint(plain, tmp_path) is plain
    for name, value in plain.named_parameters():
        assert torch.equal(value.detach(), results[0]["params"][name]), name
    for result in results:
        assert "are partitioned" in result["refusal"] and "GatheredParameters" in result["refusal"]
        assert result["inside"]


def averaged_by_group(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Net(False)
    decay = [p for name, p in model.named_parameters() if name.endswith("weight")]
    rest = [p for name, p in model.named_parameters() if not name.endswith("weight")]
    config = CONFIG | {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                       "zero_optimization": CONFIG["zero_optimization"] | {"sub_group_size": 64}}
    engine, optimizer, *_ = zero3.initialize(model=model, config=config,
                                             model_parameters=[{"params": decay}, {"params": rest, "weight_decay": 0.0}])
    engine.backward(engine(torch.randn(2, 16), torch.randint(0, 4, (2,))))
    averaged = optimizer.averaged_gradients
    out = {"keys": sorted(averaged), "lengths": [len(averaged[k]) for k in sorted(averaged)],
           "sizes": [len(decay), len(rest)], "sub_groups": len(optimizer.sub_groups),
           "equal": all(torch.equal(g, zero3.safe_get_local_grad(p).reshape(-1)[: g.numel()])
                        for g, p in zip(averaged[0] + averaged[1], decay + rest))}
    engine.destroy()
    return out


def test_averaged_gradients_are_keyed_by_parameter_group_as_deepspeeds_sub_groups_are() -> None:
    """However finely zero3 cuts its own sub-groups (a small sub_group_size here)."""
    for out in run_ranks(2, averaged_by_group):
        assert out["sub_groups"] > 2
        assert out["keys"] == [0, 1] and out["lengths"] == out["sizes"] and out["equal"]


class Scale(nn.Module):
    """An elementwise model: its output's dtype is what its inputs' and weight's promote to."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 2.0, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def forward_dtypes(rank: int, world: int, config_path: str) -> dict:
    import json

    import zero3.deepspeed as deepspeed

    x = torch.full((2, 8), 1.0 / 3.0)  # fp32, and not exact in bf16
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
    Path(config_path).write_text(json.dumps(config))
    out = {}
    for name, build, cfg in (
            ("deepspeed", deepspeed.initialize, config),
            ("deepspeed_file", deepspeed.initialize, config_path),
            ("deepspeed_cast", deepspeed.initialize, config | {"bf16": {"enabled": True, "auto_cast": True}}),
            ("zero3", zero3.initialize, config)):
        engine = build(model=Scale(), config=cfg)[0]
        y = engine(x)
        out[name] = (y.dtype, y.detach().float().clone())
        engine.destroy()
    out["config_after"] = config
    return out


def test_deepspeeds_initialize_passes_inputs_as_given_in_bf16_as_deepspeed_does(tmp_path) -> None:
    """DeepSpeed casts no input in bf16 (nor in fp16 unless `fp16.auto_cast`); a script ported by its import line
    computes what it computed there. zero3's own `initialize` keeps its cast (FSDP2's `cast_forward_inputs`)."""
    x, weight = torch.full((2, 8), 1.0 / 3.0), torch.linspace(0.5, 2.0, 8).bfloat16()
    as_given, cast = x * weight, (x.bfloat16() * weight).float()  # fp32 x bf16 promotes to fp32
    assert not torch.equal(as_given, cast)
    for out in run_ranks(2, forward_dtypes, str(tmp_path / "ds_config.json")):
        for name in ("deepspeed", "deepspeed_file"):
            assert out[name][0] == torch.float32 and torch.equal(out[name][1], as_given), name
        for name in ("deepspeed_cast", "zero3"):
            assert out[name][0] == torch.bfloat16 and torch.equal(out[name][1], cast), name
        assert "auto_cast" not in out["config_after"]["bf16"]  # the caller's dict is not changed
