"""What code written for DeepSpeed reads and passes: `ds_*` parameter attributes, `training_data`,
`enable_sanity_checks`."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import zero3
from tests import models
from tests.distributed import run_ranks

CONFIG = {
    "train_micro_batch_size_per_gpu": 3,
    "optimizer": {"type": "AdamW"},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def ds_attributes(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    plain = models.TiedTransformer()
    with zero3.Init(config=CONFIG):
        model = models.TiedTransformer()
    params = list(model.parameters())
    out = {
        "numel": sum(p.ds_numel for p in params),
        "expected_numel": sum(p.numel() for p in plain.parameters()),
        "local_numel": sum(p.numel() for p in params),  # released: 0, which is why HF reads ds_numel
        "shapes": [tuple(p.ds_shape) for p in params] == [tuple(p.shape) for p in plain.parameters()],
        "ids_unique": len({p.ds_id for p in params}) == len(params),
        "still_parameters": all(isinstance(p, torch.nn.Parameter) for p in params),
        "status_released": {p.ds_status for p in params},
    }
    engine, *_ = zero3.initialize(model=model, config=CONFIG)
    out["ds_tensor"] = all(torch.equal(p.ds_tensor, zero3.safe_get_local_lp_param(p)) for p in params)
    lp_storages = {buffer.tensor.untyped_storage().data_ptr() for buffer in engine.lp_buffers}
    out["ds_tensor_is_the_shard"] = all(p.ds_tensor.untyped_storage().data_ptr() in lp_storages for p in params)
    out["ds_tensor_numel"] = [p.ds_tensor.numel() for p in params] == [-(-p.ds_numel // world) for p in params]
    out["ds_persist"] = {p.ds_persist for p in params}
    weight = model.blocks[0].qkv.weight
    with zero3.GatheredParameters([weight]):
        out["status_gathered"] = weight.ds_status
        out["agrees_with_param_status"] = weight.ds_status is zero3.param_status(weight)
    out["status_after"] = weight.ds_status
    # DeepSpeed code sets a partition by assigning its data: this rank's shard becomes rank + 1.
    shard = weight.ds_tensor
    weight.ds_tensor.data = torch.full_like(weight.ds_tensor.data, rank + 1.0)
    out["set_shard_is_seen"] = bool((shard == rank + 1).all()) and torch.equal(
        zero3.safe_get_local_lp_param(weight), torch.full_like(shard, rank + 1.0))
    with zero3.GatheredParameters([weight]):
        out["gathered_after_set"] = weight.detach().clone()
    out["shard_numel"] = shard.numel()
    try:
        weight.ds_tensor.data = torch.zeros(shard.numel() + 1)
        out["wrong_numel"] = None
    except ValueError as error:
        out["wrong_numel"] = str(error)
    out["plain_ops"] = type(weight.ds_tensor + 1) is torch.Tensor
    import copy
    import io

    saved = io.BytesIO()
    torch.save(weight.ds_tensor, saved)  # saved as its values alone (no engine record travels with it)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    out["saved_plain"] = type(loaded) is torch.Tensor and torch.equal(loaded, weight.ds_tensor)
    out["copied_plain"] = type(copy.deepcopy(weight.ds_tensor)) is torch.Tensor
    engine.destroy()
    out["class_after_destroy"] = type(weight) is torch.nn.Parameter and not hasattr(weight, "ds_numel")
    return out


def test_parameters_carry_deepspeeds_attributes_and_ds_tensor_data_sets_the_shard() -> None:
    results = run_ranks(2, ds_attributes)
    for result in results:
        assert result["numel"] == result["expected_numel"] and result["local_numel"] == 0
        assert result["shapes"] and result["ids_unique"] and result["still_parameters"]
        assert result["status_released"] == {zero3.ZeroParamStatus.NOT_AVAILABLE}
        assert result["status_gathered"] is zero3.ZeroParamStatus.AVAILABLE and result["agrees_with_param_status"]
        assert result["status_after"] is zero3.ZeroParamStatus.NOT_AVAILABLE
        assert result["class_after_destroy"]
        assert result["ds_tensor"] and result["ds_tensor_is_the_shard"] and result["ds_tensor_numel"]
        assert result["ds_persist"] == {False}  # stage3_param_persistence_threshold: 0
        assert result["set_shard_is_seen"] and result["plain_ops"]
        assert result["saved_plain"] and result["copied_plain"]
        assert "qkv.weight" in result["wrong_numel"] and str(result["shard_numel"]) in result["wrong_numel"]
    gathered, numel = results[0]["gathered_after_set"], results[0]["shard_numel"]
    expected = torch.cat([torch.full((numel,), 1.0), torch.full((numel,), 2.0)])[: gathered.numel()]
    assert torch.equal(gathered.reshape(-1), expected.to(gathered.dtype)) and torch.equal(gathered, results[1]["gathered_after_set"])


def training_data(rank: int, world: int) -> dict:
    dataset = TensorDataset(torch.arange(20).float().unsqueeze(1), torch.arange(20))
    model = models.MLP(d_in=1)
    engine, _, loader, _ = zero3.initialize(model=model, config=CONFIG, training_data=dataset)
    seen = [batch[1].tolist() for batch in loader]
    engine.destroy()
    bad = models.MLP(d_in=1)
    before = [p.detach().clone() for p in bad.parameters()]

    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError) as info:
        zero3.initialize(model=bad, config=CONFIG, training_data=Stream())
    untouched = all(torch.equal(b, p) for b, p in zip(before, bad.parameters()))
    return {"seen": seen, "error": str(info.value), "untouched": untouched}


def test_training_data_comes_back_as_a_loader_over_this_ranks_share() -> None:
    results = run_ranks(2, training_data)
    shares = [sorted(i for batch in result["seen"] for i in batch) for result in results]
    assert sorted(shares[0] + shares[1]) == list(range(20)) and not set(shares[0]) & set(shares[1])
    for result in results:
        assert [len(batch) for batch in result["seen"]] == [3, 3, 3, 1]  # 10 items in micro-batches of 3
        assert "training_data must be a map-style dataset" in result["error"] and "Stream" in result["error"]
        assert result["untouched"]


class ReturnsAWeight(models.MLP):
    """Returns fc3's weight beside the loss: zero3 keeps it gathered until the next pass."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(x, y), self.fc3.weight


def getters(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = ReturnsAWeight()
    engine = zero3.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})[0]
    out = {
        "sizes": (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
                  engine.train_batch_size()),
        "precision": (engine.bfloat16_enabled(), engine.fp16_enabled()),
        "zero": (engine.zero_optimization(), engine.zero_optimization_stage()),
    }
    applied = []
    for step, (x, y) in enumerate(models.batches("x8", 6, 2 * world)):
        loss, _ = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        if step == 3:
            loss = loss * float("inf")  # a non-finite gradient: the step is skipped
        engine.backward(loss)
        engine.step()
        if step % 2 == 1:
            applied.append(engine.was_step_applied())
    out["applied"] = applied
    out["samples"] = (engine.global_steps, engine.global_samples)
    out["lr"] = engine.get_lr()
    # Something gathered between steps: what a forward returned is held until the next pass.
    with torch.no_grad():
        engine(x.chunk(world)[rank], y.chunk(world)[rank])
    out["live_before_empty"] = engine.coordinator.live_numel()
    engine.empty_partition_cache()
    out["gathered_after_empty"] = [unit.label for unit in engine.units if unit.state.name != "SHARDED"]
    out["live_after_empty"] = engine.coordinator.live_numel()
    engine.destroy()

    # Persistent parameters (the biases, under 100 elements) are released too, and gathered again by the next
    # forward: training goes on exactly as without the call.
    masters = {}
    for empty in (False, True):
        torch.manual_seed(0)
        model = models.MLP()
        engine = zero3.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}})[0]
        for step, (x, y) in enumerate(models.batches("x8", 3, 2 * world)):
            if empty and step == 1:
                out["persistent_before_empty"] = sum(p.numel() for p in model.parameters() if p.ds_persist)
                engine.empty_partition_cache()
                out["numel_after_empty"] = sum(p.numel() for p in model.parameters())
            engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
            engine.step()
        masters[empty] = [zero3.safe_get_local_fp32_param(p).clone() for p in model.parameters()]
        engine.destroy()
    out["same_after_empty"] = all(torch.equal(a, b) for a, b in zip(masters[False], masters[True]))
    return out


def test_deepspeeds_engine_getters_answer_as_deepspeed_does() -> None:
    for out in run_ranks(2, getters):
        assert out["sizes"] == (2, 2, 8)
        assert out["precision"] == (True, False) and out["zero"] == (True, 3)
        assert out["applied"] == [True, False, True], out["applied"]  # the second step's gradients were inf
        assert out["samples"] == (3, 24)
        assert out["lr"] == [1e-2]
        assert out["live_before_empty"] == 8 * 64 + 8  # fc3 (weight and bias: one unit), its weight returned
        assert out["gathered_after_empty"] == [] and out["live_after_empty"] == 0
        assert out["persistent_before_empty"] == 64 + 64 + 8 and out["numel_after_empty"] == 0
        assert out["same_after_empty"]


class SharesByReference(torch.nn.Module):
    """`head` uses `embed`'s weight through a plain list, where no module attribute is read: zero3 cannot
    see the use, so it must be registered (DeepSpeed's register_external_parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16, bias=False)
        self.head = Head(self.embed.weight)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.head(self.embed(x)), y)


class Head(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.hidden = [weight]  # a list: not a registered parameter, not an attribute read

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.hidden[0]


def external_and_generation(rank: int, world: int) -> dict:
    out: dict = {}
    torch.manual_seed(0)
    plain = SharesByReference()
    x, y = torch.randn(4 * world, 8), torch.randn(4 * world, 8)
    expected = plain(x.chunk(world)[rank], y.chunk(world)[rank]).item()
    torch.manual_seed(0)
    model = SharesByReference()
    zero3.register_external_parameter(model.head, model.embed.weight)
    engine = zero3.initialize(model=model, config=CONFIG)[0]
    with torch.no_grad():
        # The forward runs head after embed has released its weight: only the registration gathers it.
        out["external_loss"] = engine(x.chunk(world)[rank], y.chunk(world)[rank]).item()
    out["expected_loss"] = expected
    with zero3.unwrap_model_for_generation(engine) as whole:
        out["whole_inside"] = all(p.numel() == p.ds_numel for p in whole.parameters())
        with torch.no_grad():
            out["loss_inside"] = whole(x.chunk(world)[rank], y.chunk(world)[rank]).item()
    out["released_after"] = all(p.numel() == 0 for p in model.parameters())
    engine.destroy()
    return out


def test_an_external_parameter_registered_as_in_deepspeed_and_the_whole_model_for_generation() -> None:
    for out in run_ranks(2, external_and_generation):
        assert out["external_loss"] == pytest.approx(out["expected_loss"], rel=1e-6)
        assert out["whole_inside"] and out["loss_inside"] == pytest.approx(out["expected_loss"], rel=1e-6)
        assert out["released_after"]


def edits_without_a_modifier_rank(rank: int, world: int, sanity_checks: bool) -> dict:
    from tests.logs import zero3_messages

    warnings = zero3_messages()
    config = CONFIG | {"zero_optimization": CONFIG["zero_optimization"] | {"enable_sanity_checks": sanity_checks}}
    with zero3.Init(config=config):
        model = models.MLP()
    before = zero3.safe_get_local_lp_param(model.fc1.weight).clone()
    out: dict = {}
    for editing_rank in (None, 1):  # nobody edits; rank 1 alone edits
        warnings.clear()
        out[f"raised {editing_rank}"] = None
        try:
            with zero3.GatheredParameters([model.fc1.weight, model.fc2.weight]):
                if rank == editing_rank:
                    with torch.no_grad():
                        model.fc1.weight.add_(1.0)
        except RuntimeError as error:
            out[f"raised {editing_rank}"] = str(error)
        out[editing_rank] = [w for w in warnings if "in-place modification" in w]
    out["shard_unchanged"] = torch.equal(before, zero3.safe_get_local_lp_param(model.fc1.weight))
    if sanity_checks:  # the same engine's config: its units check too
        engine = zero3.initialize(model=model, config=config)[0]
        try:
            with zero3.GatheredParameters([model.fc1.weight]):
                if rank == 0:
                    with torch.no_grad():
                        model.fc1.weight.mul_(2.0)
            out["engine raised"] = None
        except RuntimeError as error:
            out["engine raised"] = str(error)
        engine.destroy()
    return out


def test_an_in_place_edit_without_a_modifier_rank_is_discarded_with_a_warning_as_in_deepspeed() -> None:
    """DeepSpeed discards it (and raises only under its enable_sanity_checks); zero3 says so, once."""
    for rank, out in enumerate(run_ranks(2, edits_without_a_modifier_rank, False)):
        assert out["raised None"] is None and out["raised 1"] is None
        assert out[None] == []
        if rank == 0:
            (message,) = out[1]
            assert "modifier_rank" in message and "discarded" in message
            assert "(Linear.weight on rank 1)" in message, message  # built under Init: named by its class
        else:
            assert out[1] == []
        assert out["shard_unchanged"]  # the edit was discarded, as the message says


def test_under_enable_sanity_checks_the_edit_raises_on_every_rank_as_in_deepspeed() -> None:
    """zero_optimization.enable_sanity_checks: DeepSpeed's RuntimeError, on every rank (the editing one and the
    others), under zero3.Init's config and the engine's; the edit is discarded all the same."""
    for out in run_ranks(2, edits_without_a_modifier_rank, True):
        assert out["raised None"] is None and out[None] == []
        for raised in (out["raised 1"], out["engine raised"]):
            assert raised is not None and "in-place modification" in raised and "enable_sanity_checks" in raised
        assert "Linear.weight on rank 1" in out["raised 1"]
        assert out[1] == [] and out["shard_unchanged"]


def accumulation_from_outside(rank: int, world: int) -> dict:
    """accelerate's loop: it divides the loss by the accumulation steps itself and says which micro-step
    ends an accumulation; the engine must neither divide again nor keep its own count."""
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    data = models.batches("x8", 8, 2 * world)
    masters, steps = {}, {}
    for how in ("counted", "outside", "every_micro_step"):
        torch.manual_seed(0)
        model = models.MLP()
        engine = zero3.initialize(model=model, config=config)[0]
        for i, (x, y) in enumerate(data):
            loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
            if how == "counted":
                engine.backward(loss)
            elif how == "outside":
                engine.set_gradient_accumulation_boundary(i % 2 == 1)
                assert engine.is_gradient_accumulation_boundary() == (i % 2 == 1)
                engine.backward(loss / 2, scale_wrt_gas=False)
            else:  # a boundary at every micro-step, whatever the config's accumulation says
                engine.set_gradient_accumulation_boundary(True)
                engine.backward(loss, scale_wrt_gas=False)
            engine.step()
        masters[how] = [zero3.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
        steps[how] = engine.global_steps
        engine.destroy()
    # The last: one step per micro-batch on its whole loss, as a plain loop without accumulation.
    torch.manual_seed(0)
    reference = models.MLP()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in data:
        (sum(reference(xs, ys) for xs, ys in zip(x.chunk(world), y.chunk(world))) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "steps": steps,
        "outside_is_counted": all(torch.equal(a, b) for a, b in zip(masters["counted"], masters["outside"])),
        "every_micro_step": masters["every_micro_step"],
        "reference": [p.detach().clone() for p in reference.parameters()],
    }


def test_an_accumulation_decided_outside_the_engine_as_accelerate_does() -> None:
    for out in run_ranks(2, accumulation_from_outside):
        assert out["steps"] == {"counted": 4, "outside": 4, "every_micro_step": 8}
        assert out["outside_is_counted"]  # bit-identical: no second division, no G*G micro-steps per step
        for got, expected in zip(out["every_micro_step"], out["reference"]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


class Generates(models.MLP):
    """A model with a method and an attribute the engine lacks (as a Hugging Face model has `generate`)."""

    label = "a model attribute"

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(x).argmax(-1)


def engine_forwards(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Generates()
    engine = zero3.initialize(model=model, config=CONFIG)[0]
    x = torch.randn(3, 16)
    with torch.no_grad(), zero3.GatheredParameters(list(model.parameters())):
        expected = model.fc1(x).argmax(-1)
    out = {
        "generated": torch.equal(engine.generate(x), expected),
        "label": engine.label,
        "own_config": type(engine.config).__name__,  # the engine's own attributes come first
    }
    try:
        engine.no_such_attribute
    except AttributeError as error:
        out["error"] = str(error)
    engine.destroy()
    return out


def test_the_engine_answers_what_it_lacks_from_its_module_as_deepspeeds_does() -> None:
    for out in run_ranks(2, engine_forwards):
        assert out["generated"] and out["label"] == "a model attribute" and out["own_config"] == "Zero3Config"
        assert out["error"] == "'ZeroEngine' object has no attribute 'no_such_attribute', and neither has its module (Generates)"


class WithBuffer(models.TiedTransformer):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step_count", torch.tensor([7.0]))


def consolidated(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = WithBuffer()
    model.blocks[0].requires_grad_(False)
    config = {**CONFIG, "bf16": {"enabled": True}}
    engine = zero3.initialize(model=model, config=config)[0]
    whole = engine._zero3_consolidated_16bit_state_dict()  # the name Hugging Face's save_model calls
    trained_only = engine.consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    engine.destroy()
    return {"whole": whole, "trained_only": None if trained_only is None else sorted(trained_only)}


def test_the_consolidated_16bit_state_dict_is_the_whole_model_on_rank_0() -> None:
    torch.manual_seed(0)
    plain = WithBuffer()
    expected = {name: value.to(torch.bfloat16) if value.is_floating_point() and name != "step_count" else value
                for name, value in plain.state_dict().items()}
    first, second = run_ranks(2, consolidated)
    assert second == {"whole": None, "trained_only": None}
    whole = first["whole"]
    assert list(whole) == list(expected)  # tied names both present, buffers after, in state_dict order
    for name, value in expected.items():
        assert whole[name].dtype == value.dtype and torch.equal(whole[name], value), name
    assert whole["head.weight"] is whole["embed.weight"]
    plain.load_state_dict(whole, strict=True)
    frozen = {name for name, p in plain.named_parameters(remove_duplicate=False) if name.startswith("blocks.0.")}
    assert first["trained_only"] == sorted(set(expected) - frozen)


def frozen_model(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = models.MLP()
    model.requires_grad_(False)
    engine = zero3.initialize(model=model, config=CONFIG)[0]  # the training config, optimizer section and all
    x, y = models.batches("x8", 1, 2 * world)[0]
    with torch.no_grad():
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank]).item()
    out = {"optimizer": engine.optimizer, "bytes": engine.model_state_bytes(), "loss": loss}
    engine.destroy()
    torch.manual_seed(0)
    plain = models.MLP()
    out["plain_loss"] = plain(x.chunk(world)[rank], y.chunk(world)[rank]).item()
    return out


def test_a_frozen_model_gets_no_optimizer_and_no_optimizer_state() -> None:
    # TRL builds its reference model with the training config: nothing to step, so nothing is kept for a step.
    for out in run_ranks(2, frozen_model):
        assert out["optimizer"] is None
        assert out["bytes"]["hp_params"] == out["bytes"]["optim_states"] == out["bytes"]["lp_grads"] == 0
        assert out["bytes"]["contiguous_grad_buffer"] == 0
        assert out["loss"] == out["plain_loss"]


def plain_backward(rank: int, world: int) -> dict:
    """DeepSpeed 0.19's direct backward: `loss.backward()` (or `engine.scale(loss).backward()`) trains as
    `engine.backward(loss)`, gradients divided by the accumulation steps."""
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    data = models.batches("x8", 6, 2 * world)
    masters = {}
    for how in ("engine", "plain", "scaled"):
        torch.manual_seed(0)
        model = models.MLP()
        engine = zero3.initialize(model=model, config=config)[0]
        for x, y in data:
            loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
            if how == "engine":
                engine.backward(loss)
            elif how == "plain":
                loss.backward()
            else:
                engine.scale(loss).backward()
            engine.step()
        masters[how] = [zero3.safe_get_local_fp32_param(p).clone() for p in model.parameters()]
        engine.destroy()
    out = {how: all(torch.equal(a, b) for a, b in zip(masters["engine"], masters[how])) for how in ("plain", "scaled")}

    # Under an fp16 loss scale a plain backward of the unscaled loss is an error on every rank (it would
    # underflow silently); engine.scale(loss).backward() then trains as engine.backward(loss).
    fp16 = {**config, "fp16": {"enabled": True, "loss_scale": 1024}}
    fp16_masters = {}
    for how in ("engine", "scaled"):
        torch.manual_seed(0)
        model = models.MLP()
        engine = zero3.initialize(model=model, config=fp16)[0]
        if how == "scaled":
            x, y = data[0]
            try:
                engine(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            except RuntimeError as error:
                out["unscaled_fp16"] = str(error)
                engine.zero_grad()
        for x, y in data:
            loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
            if how == "engine":
                engine.backward(loss)
            else:
                engine.scale(loss).backward()
            engine.step()
        fp16_masters[how] = [zero3.safe_get_local_fp32_param(p).clone() for p in model.parameters()]
        engine.destroy()
    out["fp16_scaled"] = all(torch.equal(a, b) for a, b in zip(fp16_masters["engine"], fp16_masters["scaled"]))
    return out


@pytest.mark.parametrize("world", [1, 2])  # a world of one saves by reference (zero3.passes.coordinator)
def test_a_plain_loss_backward_trains_as_engine_backward_as_in_deepspeed(world: int) -> None:
    for out in run_ranks(world, plain_backward):
        assert out["plain"] and out["scaled"]  # bit-identical, accumulation 2 and clipping included
        assert "engine.scale(loss).backward()" in out["unscaled_fp16"]
        assert out["fp16_scaled"]


def gradients_landed(rank: int, world: int) -> dict:
    """After a plain loss.backward(), allreduce_gradients() lands the pass: the reduced shards are there
    to read before step(), as after engine.backward()."""
    config = {**CONFIG, "gradient_accumulation_steps": 2}
    x, y = models.batches("x8", 1, 6 * world)[0]
    grads = {}
    for how in ("engine", "plain"):
        torch.manual_seed(0)
        model = models.MLP()
        engine = zero3.initialize(model=model, config=config)[0]
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        if how == "engine":
            engine.backward(loss)
        else:
            loss.backward()
            engine.allreduce_gradients()
        grads[how] = [zero3.safe_get_local_grad(p).clone() for p in model.parameters()]
        engine.allreduce_gradients()  # nothing left to land: a no-op
        engine.destroy()
    return {"same": all(torch.equal(a, b) for a, b in zip(grads["engine"], grads["plain"])),
            "nonzero": all(bool(g.abs().sum() > 0) for g in grads["plain"])}


def test_allreduce_gradients_lands_a_plain_backward_as_deepspeeds_does() -> None:
    for out in run_ranks(2, gradients_landed):
        assert out == {"same": True, "nonzero": True}


def gathered_by_hand(rank: int, world: int) -> dict:
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p0 = torch.nn.Parameter(torch.arange(1.0, 6.0))  # 5 elements: padded at 2 ranks
            self.p1 = torch.nn.Parameter(torch.arange(1.0, 8.0))

    with zero3.Init(config=CONFIG):
        module = Holder()
    params = [module.p0, module.p1]
    out: dict = {"released_before": [p.numel() for p in params]}
    params[0].all_gather_coalesced(params).wait()
    out["gathered"] = [p.detach().clone() for p in params]
    out["status"] = {p.ds_status for p in params}
    try:
        params[1].all_gather()
        out["twice"] = None
    except RuntimeError as error:
        out["twice"] = str(error)
    with torch.no_grad():
        params[0].add_(100.0)  # discarded at partition, as in DeepSpeed
    params[0].partition(params)
    out["released_after"] = [p.numel() for p in params]
    out["status_after"] = {p.ds_status for p in params}
    with zero3.GatheredParameters(params):
        out["values_after"] = [p.detach().clone() for p in params]
    return out


def test_deepspeeds_param_all_gather_coalesced_and_partition_gather_and_release_by_hand() -> None:
    """DeepSpeed's `param.all_gather_coalesced(params).wait()` ... `param.partition()` (its
    stage3_use_all_reduce_for_fetch_params test reads the gathered values so): whole values, exactly."""
    for out in run_ranks(2, gathered_by_hand):
        assert out["released_before"] == [0, 0] and out["released_after"] == [0, 0]
        assert torch.equal(out["gathered"][0], torch.arange(1.0, 6.0))
        assert torch.equal(out["gathered"][1], torch.arange(1.0, 8.0))
        assert out["status"] == {zero3.ZeroParamStatus.AVAILABLE}
        assert out["status_after"] == {zero3.ZeroParamStatus.NOT_AVAILABLE}
        assert "already gathered" in out["twice"] and "partition()" in out["twice"]
        assert torch.equal(out["values_after"][0], torch.arange(1.0, 6.0))  # the edit was discarded
