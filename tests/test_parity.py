"""Loss parity against a plain single-process PyTorch reference, at world sizes 1 and 2."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint

import zero3
from tests import models
from tests.devices import to_device, worlds_on_devices
from tests.distributed import run_ranks

MODELS = {
    "mlp": (models.MLP, "x8"),
    "tied_transformer": (models.TiedTransformer, "tokens"),
    "attribute_tied": (models.AttributeTiedLM, "tokens"),
    "dangling_bias": (models.DanglingBias, "x4"),
    "dict_output": (models.DictOutput, "x8"),
    "none_output": (models.NoneOutput, "x8"),
    "dataclass_output": (models.DataclassOutput, "x8"),
    "checkpointed": (models.CheckpointedTransformer, "tokens"),
    "frozen_layer": (models.FrozenFirstLayer, "x8"),
    "branchy": (models.Branchy, "branch"),
    "gradient_penalty": (models.GradientPenalty, "x8"),
}
LR, WD, CLIP, MICRO = 3e-3, 0.01, 1.0, 4


def config(precision: str, gas: int, **zero: object) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_and_compare(
    rank: int, world: int, name: str, precision: str, steps: int, gas: int, use_init: bool, zero: dict,
    grouped: bool = False, checkpoint_root: bool = False,
) -> dict:
    cls, kind = MODELS[name]
    cfg = config(precision, gas, **zero)
    torch.manual_seed(0)
    reference = cls()
    torch.manual_seed(0)
    if use_init:
        with zero3.Init(config=cfg):
            model = cls()
    else:
        model = cls()
    engine, _, _, _ = zero3.initialize(model=model, model_parameters=param_groups(model, grouped), config=cfg)
    if use_init:
        # Init built the model on the engine's device, from that device's generator (CUDA's draws differ
        # from the CPU's): the reference is built there from the same seed, then trained on the host.
        torch.manual_seed(0)
        with torch.device(engine.device):
            reference = cls()
        reference = reference.cpu()
    data = models.batches(kind, steps, MICRO * gas * world)
    losses = []
    states = set()  # between micro-steps
    for x, y in data:
        step_loss = torch.zeros(1, device=engine.device)  # nccl reduces device tensors
        xs, ys = to_device((x.chunk(gas * world), y.chunk(gas * world)), engine.device)
        for k in range(gas):
            piece = k * world + rank
            if checkpoint_root:  # the whole forward runs again inside backward (reentrant: under no_grad first)
                inputs = xs[piece].clone().requires_grad_()
                output = torch.utils.checkpoint.checkpoint(engine, inputs, ys[piece], use_reentrant=True)
            else:
                output = engine(xs[piece], ys[piece])
            loss = models.loss_of(output, model)
            engine.backward(loss)
            engine.step()
            states.add(engine.protocol.state)
            step_loss += loss.detach().float() / gas
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
    ref_losses, reference = models.reference_losses(
        reference, data, LR, WD, CLIP, gas=gas * world, groups=param_groups(reference, grouped))
    max_param_diff = 0.0
    for (pname, p), (_, ref_p) in zip(model.named_parameters(), reference.named_parameters()):
        full = models.full_value(p)
        max_param_diff = max(max_param_diff, (full - ref_p.detach()).abs().max().item())
    statuses = {zero3.param_status(p) for p in model.parameters()}
    engine.destroy()
    return {"losses": losses, "reference": ref_losses, "param_diff": max_param_diff, "statuses": statuses,
            "states": states}


def param_groups(model: torch.nn.Module, grouped: bool) -> list:
    """Two groups (biases and norms: no decay, half lr), or all parameters.

    By name, as HF does: under Init a parameter's `.shape` is its released placeholder's.
    """
    if not grouped:
        return list(model.parameters())
    named = list(model.named_parameters())
    plain = [p for n, p in named if not (n.endswith("bias") or ".ln" in n or n.startswith("ln"))]
    no_decay = [p for n, p in named if n.endswith("bias") or ".ln" in n or n.startswith("ln")]
    return [{"params": plain, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": LR / 2}]


def _rel_errors(result: dict) -> list[float]:
    return [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result["losses"], result["reference"])]


@worlds_on_devices(1, 2)
@pytest.mark.parametrize("name", ["mlp", "tied_transformer"])
def test_fp32_loss_parity(world: int, device: str, name: str) -> None:
    results = run_ranks(world, train_and_compare, name, "fp32", 6, 1, False, {})
    for result in results:
        assert len(result["losses"]) == 6
        assert max(_rel_errors(result)) <= 1e-5, (result["losses"], result["reference"])
        assert result["param_diff"] < 1e-5
        assert result["statuses"] == {zero3.ParamStatus.NOT_AVAILABLE}


def test_fp32_parity_with_init_accumulation_prefetch_and_param_groups() -> None:
    """Init-built model, 2 micro-steps per step, small buckets and sub-groups, an active
    prefetcher, and two optimizer groups with their own lr and weight decay."""
    zero = {"reduce_bucket_size": 3000, "stage3_prefetch_bucket_size": 5000, "overlap_comm": True,
            "sub_group_size": 2000}
    results = run_ranks(2, train_and_compare, "tied_transformer", "fp32", 5, 2, True, zero, True)
    for result in results:
        assert max(_rel_errors(result)) <= 1e-5, (result["losses"], result["reference"])
        assert result["param_diff"] < 1e-5


@worlds_on_devices(1, 2)
def test_bf16_loss_parity(world: int, device: str) -> None:
    results = run_ranks(world, train_and_compare, "tied_transformer", "bf16", 6, 1, True, {})
    for result in results:
        # bf16 keeps 8 bits of mantissa: losses agree to about 1%, and training goes down.
        assert max(_rel_errors(result)) <= 2e-2, (result["losses"], result["reference"])
        assert result["losses"][-1] < result["losses"][0]


@worlds_on_devices(1, 2)
@pytest.mark.parametrize("name", ["dangling_bias", "attribute_tied", "dict_output", "none_output", "dataclass_output"])
def test_output_shapes_and_external_params_train(world: int, device: str, name: str) -> None:
    results = run_ranks(world, train_and_compare, name, "fp32", 5, 1, False, {})
    for result in results:
        assert max(_rel_errors(result)) <= 1e-5, (name, result["losses"], result["reference"])
        assert result["param_diff"] < 1e-5


# A world of one runs forward without saved-tensor hooks (the coordinator's Note: saved by reference).
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["checkpointed", "frozen_layer"])
def test_activation_checkpointing_and_frozen_params(world: int, name: str) -> None:
    for result in run_ranks(world, train_and_compare, name, "fp32", 5, 1, True, {"stage3_prefetch_bucket_size": 4000}):
        assert max(_rel_errors(result)) <= 1e-5, (name, result["losses"], result["reference"])
        assert result["param_diff"] < 1e-5


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name, checkpoint_root", [("gradient_penalty", False), ("mlp", True)])
def test_nested_passes_train_exactly(world: int, name: str, checkpoint_root: bool) -> None:
    """A backward inside forward (a gradient penalty) and a forward inside backward (the root
    checkpointed): each pass ends where it began, and training matches plain PyTorch."""
    for result in run_ranks(world, train_and_compare, name, "fp32", 4, 1, False, {}, False, checkpoint_root):
        assert max(_rel_errors(result)) <= 1e-5, (name, result["losses"], result["reference"])
        assert result["param_diff"] < 1e-5
        assert {state.name for state in result["states"]} == {"IDLE"}


def test_changing_module_order_never_breaks_prefetch() -> None:
    """A stale prefetch trace (the route changes every step) costs overlap, never correctness."""
    zero = {"stage3_prefetch_bucket_size": 100_000, "reduce_bucket_size": 2000}
    for result in run_ranks(2, train_and_compare, "branchy", "fp32", 8, 1, False, zero):
        assert max(_rel_errors(result)) <= 1e-5, (result["losses"], result["reference"])
        assert result["param_diff"] < 1e-5
