"""zero3.Init: partition at construction; writes after partitioning take effect or raise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero3
from tests.devices import cpu_ranks_or_one_gpu, on_host
from tests.distributed import run_ranks

CFG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}

# At two ranks on the CPU, and at one on CUDA (two nccl ranks cannot share a GPU), where Init builds on the device.
TWO_RANKS_OR_ONE_GPU = cpu_ranks_or_one_gpu(2)


class Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 10)
        self.norm = nn.LayerNorm(10)


class ReinitParent(nn.Module):
    """A parent constructor that re-initialises its children's weights in every common way."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Child()
        self.b = Child()
        self.head = nn.Linear(10, 7)
        self.apply(self._init_weights)  # HF-style: .data.normal_ / .data.zero_
        nn.init.kaiming_uniform_(self.b.fc.weight, a=0.1)  # needs the true shape (fan-in)
        nn.init.trunc_normal_(self.head.weight, std=0.3)  # several in-place ops in a row
        nn.init.constant_(self.b.norm.weight, 0.5)
        with torch.no_grad():
            self.a.norm.bias += 0.125  # an in-place operator
            self.b.norm.bias[:3] = 2.0  # __setitem__ on a slice
        self.a.fc.bias.data = torch.full((10,), 0.75)  # assignment to .data
        self.b.fc.bias = nn.Parameter(torch.full((10,), -0.5))  # a whole new child parameter

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            module.bias.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b.norm(self.b.fc(x)) + self.a.norm(self.a.fc(x)))


class ReadingParent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Child()
        self.total = self.child.fc.weight.sum()  # a read of a partitioned weight


class GatheringParent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Child()
        with zero3.GatheredParameters(list(self.child.fc.parameters()), modifier_rank=0), torch.no_grad():
            # whole values inside; rank 0's edit is kept on exit (other ranks' edits are not)
            scale = 100 if torch.distributed.get_rank() == 0 else 1
            self.child.fc.weight.copy_(torch.arange(120.0).view(10, 12) / scale)
            self.child.fc.bias.fill_(-1.0)


def build_and_compare(rank: int, world: int, cls_name: str) -> dict:
    cls = {"reinit": ReinitParent, "gathering": GatheringParent}[cls_name]
    torch.manual_seed(7)
    with zero3.Init(config=CFG):
        model = cls()
    released = all(p.numel() == 0 for p in model.parameters())
    statuses = {zero3.param_status(p) for p in model.parameters()}
    shard_elems = sum(zero3.safe_get_local_lp_param(p).numel() for p in model.parameters())
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    fulls = {n: zero3.safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    diffs = {}
    if cls_name == "reinit":
        # Built where Init built it (the engine's device), from the same seed: the same generator draws the
        # same values (a CPU reference would not match a model Init built on CUDA).
        torch.manual_seed(7)
        with torch.device(engine.device):
            reference = cls()
        diffs = {n: (fulls[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()}
    engine.destroy()
    return {"released": released, "statuses": statuses, "diffs": diffs, "fulls": on_host(fulls),
            "shard_elems": shard_elems, "total": sum(f.numel() for f in fulls.values())}


@TWO_RANKS_OR_ONE_GPU
def test_parent_constructor_writes_take_effect_exactly(world: int, device: str) -> None:
    for result in run_ranks(world, build_and_compare, "reinit"):
        assert result["released"], "parameters must be partitioned when the constructor returns"
        assert result["statuses"] == {zero3.ParamStatus.NOT_AVAILABLE}
        # Same seed, same values as a model built without Init: every write landed.
        assert max(result["diffs"].values()) == 0.0, result["diffs"]
        assert result["fulls"]["b.norm.weight"].eq(0.5).all()
        assert result["fulls"]["b.norm.bias"][:3].eq(2.0).all()
        assert result["fulls"]["a.norm.bias"].eq(0.125).all()
        assert result["fulls"]["a.fc.bias"].eq(0.75).all()
        assert result["fulls"]["b.fc.bias"].eq(-0.5).all()
        # Each rank holds about its share of the elements.
        assert result["shard_elems"] <= result["total"] // world + 16


@TWO_RANKS_OR_ONE_GPU
def test_gathered_parameters_modifier_rank_inside_init(world: int, device: str) -> None:
    results = run_ranks(world, build_and_compare, "gathering")
    for result in results:
        # The constructor's arange ran on Init's device; CUDA divides by a scalar through its reciprocal,
        # so the expected value is computed there too.
        expected = (torch.arange(120.0, device=device).view(10, 12) / 100).cpu()
        assert torch.equal(result["fulls"]["child.fc.weight"], expected)
        assert result["fulls"]["child.fc.bias"].eq(-1.0).all()


def read_in_constructor(rank: int, world: int) -> str:
    with zero3.Init(config=CFG):
        try:
            ReadingParent()
        except RuntimeError as err:
            return str(err)
    return ""


def test_read_of_partitioned_param_in_constructor_raises_with_guidance() -> None:
    for message in run_ranks(2, read_in_constructor):
        assert "GatheredParameters" in message and "modifier_rank=0" in message
        assert "Linear.weight" in message


def test_init_restores_module_classes() -> None:
    original = nn.Linear.__init__
    with zero3.Init(config=CFG):
        assert nn.Linear.__init__ is not original
    assert nn.Linear.__init__ is original
    plain = nn.Linear(3, 3)
    assert plain.weight.numel() == 9 and not hasattr(plain.weight, "_zero3")


def test_bad_modifier_rank_is_rejected_before_gathering() -> None:
    with zero3.Init(config=CFG):
        lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="modifier_rank=5"):
        zero3.GatheredParameters(list(lin.parameters()), modifier_rank=5)
    assert zero3.param_status(lin.weight) is zero3.ParamStatus.NOT_AVAILABLE


def test_deepspeed_keyword_for_the_config() -> None:
    with zero3.Init(config_dict_or_path={"bf16": {"enabled": True}}):
        lin = nn.Linear(4, 4)
    assert zero3.safe_get_local_lp_param(lin.weight).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not both"):
        zero3.Init(config=CFG, config_dict_or_path=CFG)


# ---- DeepSpeed's other ways in ----------------------------------------------------------
class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    with zero3.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def deepspeed_ways(rank: int, world: int) -> dict:
    out: dict = {}
    torch.manual_seed(0)
    reference = Pair()
    expected = {name: p.detach().clone() for name, p in reference.named_parameters()}

    # An Init inside another does nothing: the outer one partitions, once.
    torch.manual_seed(0)
    with zero3.Init(config=CFG):
        with zero3.Init(config_dict_or_path=CFG):
            nested = Pair()
    out["nested_partitioned"] = all(p.numel() == 0 and p.ds_numel > 0 for p in nested.parameters())
    out["nested_values"] = all(torch.equal(v, expected[k]) for k, v in whole(nested).items())

    # Init(module=m): a module built whole, partitioned now (rank 0's values).
    torch.manual_seed(0)
    built = Pair()
    zero3.Init(module=built, config_dict_or_path=CFG, remote_device="cpu", pin_memory=True,
               mem_efficient_linear=False)
    out["module_partitioned"] = all(p.numel() == 0 for p in built.parameters())
    out["module_values"] = all(torch.equal(v, expected[k]) for k, v in whole(built).items())

    # module.cpu() / .to(dtype) / .to_empty() inside the context leave partitioned parameters alone.
    torch.manual_seed(0)
    with zero3.Init(config=CFG):
        moved = Pair()
        moved.cpu()
        moved.to(torch.float16)
        moved.to_empty(device="cpu")
    out["moved_values"] = all(torch.equal(v, expected[k]) for k, v in whole(moved).items())

    # A module built on the meta device (skip_init) is partitioned without values; they are loaded after.
    with zero3.Init(config=CFG):
        skipped = torch.nn.utils.skip_init(nn.Linear, 12, 16)
    out["meta_partitioned"] = skipped.weight.numel() == 0 and skipped.weight.ds_shape == (16, 12)
    with zero3.GatheredParameters(list(skipped.parameters()), modifier_rank=0):
        if rank == 0:
            skipped.load_state_dict(reference.fc1.state_dict())
    out["meta_loaded"] = all(torch.equal(v, expected[f"fc1.{k}"]) for k, v in whole(skipped).items())

    for name, make in (
        ("positional_config", lambda: zero3.Init(CFG)),
        ("other_group", lambda: zero3.Init(config=CFG, data_parallel_group=object())),
        ("mpu", lambda: zero3.Init(config=CFG, mpu=object())),
    ):
        try:
            make()
            out[name] = None
        except (TypeError, ValueError) as error:
            out[name] = str(error)
    return out


def test_deepspeeds_init_arguments_nested_contexts_module_moves_and_meta_modules() -> None:
    for out in run_ranks(2, deepspeed_ways):
        assert out["nested_partitioned"] and out["nested_values"]
        assert out["module_partitioned"] and out["module_values"]
        assert out["moved_values"]
        assert out["meta_partitioned"] and out["meta_loaded"]
        assert "first argument is `module`" in out["positional_config"]
        assert "data_parallel_group" in out["other_group"]
        assert "mpu" in out["mpu"]


def engine_inside_init(rank: int, world: int) -> dict:
    """DeepSpeed's test_shutdown_in_nesting_init, with values checked: an engine built inside an Init
    context, and a module built in the same context after it."""
    torch.manual_seed(3)
    reference = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    expected = reference(x).square().mean().item()
    out: dict = {}
    with zero3.Init(config=CFG):
        torch.manual_seed(3)
        first = nn.Linear(4, 4)
        engine, *_ = zero3.initialize(model=first, model_parameters=first.parameters(), config=CFG)
        out["loss"] = engine(x.to(engine.device)).square().mean().item()
        engine.backward(engine(x.to(engine.device)).square().mean())
        engine.step()
        second = nn.Linear(4, 4)  # after the build: partitioned as it is built, and guarded again
        out["second_partitioned"] = {zero3.param_status(p) for p in second.parameters()}
        try:
            ReadingParent()
            out["read_error"] = ""
        except RuntimeError as err:
            out["read_error"] = str(err)
    other, *_ = zero3.initialize(model=second, model_parameters=second.parameters(), config=CFG)
    out["second_runs"] = bool(torch.isfinite(other(x.to(other.device))).all())
    out["expected"] = expected
    engine.destroy()
    other.destroy()
    return out


def test_an_engine_built_inside_init_and_a_module_built_after_it() -> None:
    for out in run_ranks(2, engine_inside_init):
        assert out["loss"] == pytest.approx(out["expected"], rel=1e-6, abs=1e-7)
        assert out["second_partitioned"] == {zero3.ParamStatus.NOT_AVAILABLE} and out["second_runs"]
        assert "GatheredParameters" in out["read_error"]
