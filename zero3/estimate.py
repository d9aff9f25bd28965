"""`zero3 estimate`: one rank's bytes of each state on the device, the host and disk, before anything is built.

Like DeepSpeed's `estimate_zero3_model_states_mem_needs_all_live`, but per
state (the five of `offload_states`, plus the gathered persistent parameters)
and per tier (`offload_optimizer`, `offload_param`).

[Note: estimating exactly]
Given a model (built on the meta device: a Hugging Face config, or the
built-in GPT), the estimate runs the engine's own layout code on it rather
than a formula: `ShardedParam` pads and shards each parameter,
`build_units` groups them into gather units and picks the persistent ones
(`stage3_param_persistence_threshold`), `split_units` chooses which shards
stay in host memory with `offload_param: nvme`, and a `GradientReducer` cuts
the buckets and sizes the scratch (`contiguous_grad_buffer`). None of these
allocates anything (a meta model holds no data), so the numbers are the
engine's to the byte and cannot drift from it. Two small rules are mirrored
here instead, each next to the engine code it copies: where each state's
tier keeps it (`zero3.offload.tiers`), and when the persistent unit's
gathered copy costs memory (`GatherUnit.gathers_in_place`).

Given only a parameter count, there is no per-parameter padding to compute:
the estimate is ZeRO-3's formula (one flat shard of ceil(P/N) elements, no
persistent parameters, no parameter larger than the reduce bucket). The
largest model that fits a device comes from that formula too.

Bytes are model state and the scratch bucket only: the gathered working set
of the layers in flight, activations and the allocator's slack come on top.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from zero3.config import ZeroConfig, Zero3Config
from zero3.engine_state import MODEL_STATES
from zero3.enums import OffloadStateType
from zero3.offload.optimizer_tier import FP32_BYTES
from zero3.offload.param_tier import split_units
from zero3.moe import check_autoep_size, find_experts
from zero3.moe.expert_parallel import SHARE, ExpertShare, expert_share
from zero3.partition.collectives import GradReduce, ParamGather
from zero3.shard_mesh import ShardMesh, TopologyError, expert_group_size, hpz_group_size, mics_group_size
from zero3.partition.leaf_modules import leaf_of
from zero3.partition.lean import in_effect, lean_units, masters_are_shards
from zero3.step.grad_shards import made_on_demand
from zero3.partition.partitioner import build_units
from zero3.partition.sharded_param import ATTR, ShardedParam, sharded
from zero3.passes.grad_reducer import GradientReducer, bucket_capacity, slot_count
from zero3.optim import spec as optimizer_spec

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TIERS = ("none", "cpu", "nvme")
ACCELERATORS = ("cuda", "cpu")
PLACES = ("device", "host", "disk")
# Model state first (what `engine.model_state_bytes()["total"]` adds up), then the scratch bucket.
STATES = (*MODEL_STATES, "contiguous_grad_buffer")
# The states `engine.state_report()` covers.
REPORTED_STATES = tuple(state.value for state in OffloadStateType)

_ZERO_DEFAULTS = ZeroConfig()


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, known in PRECISIONS.items() if known == dtype)


def _choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{what} {value!r}: expected one of {', '.join(choices)}")


@dataclass(frozen=True)
class EstimateSettings:
    """The engine settings that decide each state's size and place (the config's names in comments)."""

    precision: str = "bf16"  # bf16.enabled / fp16.enabled / neither
    offload_optimizer: str = "none"  # zero_optimization.offload_optimizer.device
    offload_param: str = "none"  # zero_optimization.offload_param.device
    reduce_bucket_size: int = _ZERO_DEFAULTS.reduce_bucket_size
    persistence_threshold: int = _ZERO_DEFAULTS.stage3_param_persistence_threshold
    # stage3_model_persistence_threshold: the persistent parameters' elements in all
    model_persistence_threshold: int = _ZERO_DEFAULTS.stage3_model_persistence_threshold
    overlap_comm: bool = _ZERO_DEFAULTS.overlap_comm
    max_in_cpu: int = _ZERO_DEFAULTS.offload_param.max_in_cpu  # offload_param.max_in_cpu (nvme only)
    grad_accum_dtype: str | None = None  # data_types.grad_accum_dtype (None: the precision)
    communication_dtype: str | None = None  # communication_data_type (None: the precision)
    accelerator: str = "cuda"  # the engine's device: "cpu" makes the device host memory
    # fp32 states the optimizer keeps per element besides the master (Adam: 2; SGD with momentum: 1).
    optimizer_states: int = 2
    # zero_optimization.mics_shard_size: the ranks each state is sharded over (-1: every rank)
    mics_shard_size: int = -1
    # zero_optimization.zero_hpz_partition_size: hpZ's secondary group (1 or 0: off)
    hpz_partition_size: int = 1
    # zero_optimization.lean_memory: no 16-bit shards for the trained parameters (zero3.partition.lean)
    lean_memory: bool = False
    # expert_parallel.autoep_size (1: off): each expert layer's experts shared out over groups of that many ranks
    autoep_size: int = 1

    def __post_init__(self) -> None:
        _choice("precision", self.precision, tuple(PRECISIONS))
        _choice("offload_optimizer", self.offload_optimizer, TIERS)
        _choice("offload_param", self.offload_param, TIERS)
        _choice("accelerator", self.accelerator, ACCELERATORS)
        for name in ("grad_accum_dtype", "communication_dtype"):
            value = getattr(self, name)
            if value is not None:
                _choice(name, value, tuple(PRECISIONS))
        for name, least in (
            ("reduce_bucket_size", 1), ("persistence_threshold", 0), ("model_persistence_threshold", 0),
            ("max_in_cpu", 0), ("optimizer_states", 0), ("hpz_partition_size", 0), ("autoep_size", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} {value!r}: expected a whole number >= {least}")
        if self.lean_memory and (self.offload_param != "none" or self.offload_optimizer == "nvme"):
            raise ValueError("lean_memory: not with offload_param, nor with offload_optimizer nvme (the config's rule)")
        size = self.mics_shard_size
        if isinstance(size, bool) or not isinstance(size, int) or size == 0 or size < -1:
            raise ValueError(f"mics_shard_size {size!r}: expected -1 (every rank) or a positive number of ranks")

    def shard_group_size(self, world_size: int) -> int:
        """The ranks a state is sharded over at `world_size` (the engine's rule, and its error)."""
        return mics_group_size(self.mics_shard_size, world_size)

    def secondary_group_size(self, shard_size: int, ranks_per_node: int) -> int:
        """hpZ's secondary group (1: off), by the engine's rule and with its error."""
        return hpz_group_size(self.hpz_partition_size, shard_size, ranks_per_node)

    @classmethod
    def from_config(cls, config: Zero3Config, accelerator: str = "cuda") -> "EstimateSettings":
        """The settings an engine built from `config` on `accelerator` runs with."""
        zc = config.zero_optimization
        return cls(
            precision=_dtype_name(config.compute_dtype),
            offload_optimizer=zc.offload_optimizer.device,
            offload_param=zc.offload_param.device,
            reduce_bucket_size=zc.reduce_bucket_size,
            persistence_threshold=zc.stage3_param_persistence_threshold,
            model_persistence_threshold=zc.stage3_model_persistence_threshold,
            overlap_comm=zc.overlap_comm,
            max_in_cpu=zc.offload_param.max_in_cpu,
            # Left unset when the config leaves them unset, so they follow a precision chosen later.
            grad_accum_dtype=config.data_types.grad_accum_dtype,
            communication_dtype=config.communication_data_type,
            accelerator=accelerator,
            optimizer_states=_optimizer_states(config),
            mics_shard_size=zc.mics_shard_size,
            hpz_partition_size=zc.zero_hpz_partition_size,
            lean_memory=zc.lean_memory,
            autoep_size=config.expert_parallel.size,
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def lean(self) -> bool:
        """Whether the trained parameters' shards are cast from masters of their own (build's rule)."""
        return in_effect(self.lean_memory, self.compute_dtype, self.offload_optimizer, self.offload_param)

    @property
    def grad_dtype(self) -> torch.dtype:
        return PRECISIONS[self.grad_accum_dtype] if self.grad_accum_dtype else self.compute_dtype

    @property
    def comm_dtype(self) -> torch.dtype:
        return PRECISIONS[self.communication_dtype] if self.communication_dtype else self.compute_dtype


def _optimizer_states(config: Zero3Config) -> int:
    """How many elementwise states the config's optimizer keeps (Adam's count without one)."""
    if config.optimizer is None:
        return EstimateSettings.optimizer_states
    layout = optimizer_spec.probe(optimizer_spec.from_config(config.optimizer), torch.device("cpu"))
    return len(layout.elementwise)


@dataclass(frozen=True)
class RankLayout:
    """One rank's element counts, as the engine lays them out: what the bytes are made of."""

    lp_in_memory: int  # 16-bit shard elements in memory (the device, or the host with offload_param)
    lp_on_disk: int  # 16-bit shard elements in offload_param's file
    trainable: int  # elements of each optimizer buffer (hp_params, lp_grads, each moment)
    persistent_gathered: int  # elements of the gathered persistent unit (0 when it gathers in place)
    scratch: int  # elements of the reduce bucket (contiguous_grad_buffer)
    hpz_secondary: int = 0  # 16-bit elements of hpZ's secondary shards (zero3.partition.secondary)
    shard_group: int = 1  # the ranks each state is split over


def layout_of_model(model: nn.Module, world_size: int, settings: EstimateSettings, secondary: int = 1) -> RankLayout:
    """The engine's layout of `model` at `world_size`, computed by the engine's own code (see the Note).

    `model` should hold no data (build it on the meta device); it is left as it was. `secondary`: hpZ's
    secondary group size (1: off).
    """
    if any(sharded(p) is not None for p in model.parameters()):
        raise ValueError("the model's parameters are already partitioned by zero3: build it on the meta device")
    mesh = ShardMesh.geometry(world_size)  # sizes only: the layout code issues no collective here
    # Expert parallelism: each expert weight stands in as rank 0's share, sharded over its expert-data group
    # (the ranks of the shard group that hold that share), as the engine lays it out.
    expert_mesh = ShardMesh.geometry(world_size // settings.autoep_size) if settings.autoep_size > 1 else None
    shared = _stand_in_shares(model, settings.autoep_size, world_size) if expert_mesh is not None else []
    params = list(model.parameters())  # unique, in the order the engine's optimizer takes them
    device = torch.device("meta")
    try:
        by_param = {
            id(p): ShardedParam(p, name, expert_mesh if expert_mesh is not None and expert_share(p) is not None
                                else mesh, settings.compute_dtype, device)
            for name, p in model.named_parameters()
        }
        expert_gather = ParamGather(expert_mesh, None, own_group=True) if expert_mesh is not None else None
        units, _, persistent = build_units(
            model, ParamGather(mesh, None), settings.persistence_threshold, settings.model_persistence_threshold,
            leaf_of(model), expert_gather,
        )
        all_units = units + ([persistent] if persistent is not None else [])  # the engine's all_units
        trainable = [by_param[id(p)] for p in params if p.requires_grad]
        lean = set(lean_units(all_units, set(trainable))) if settings.lean else set()
        kept = [unit for unit in all_units if unit not in lean]  # lay_out_params' units
        if settings.offload_param == "nvme":
            in_memory, on_disk = split_units(kept, settings.max_in_cpu)
        else:
            in_memory, on_disk = kept, []
        reducer = GradientReducer(
            GradReduce(mesh, None), trainable, settings.comm_dtype, device, settings.reduce_bucket_size,
            settings.overlap_comm,
            expert_reduce=GradReduce(expert_mesh, None, own_group=True) if expert_mesh is not None else None,
        )
        dense = [unit for unit in units if unit.gather.mesh is mesh]  # hpZ's secondary shards: the dense part's
        return RankLayout(
            lp_in_memory=sum(unit.shard_numel for unit in in_memory),
            lp_on_disk=sum(unit.shard_numel for unit in on_disk),
            trainable=sum(sp.shard_numel for sp in trainable),
            persistent_gathered=_persistent_gathered_numel(
                persistent.shard_numel if persistent is not None else 0, world_size, settings, persistent in lean
            ),
            scratch=reducer.scratch_numel(),
            # SecondaryShards: world/secondary primary shards of every unit but the persistent one
            hpz_secondary=world_size // secondary * sum(unit.shard_numel for unit in dense) if secondary > 1 else 0,
            shard_group=world_size,
        )
    finally:
        for p in params:
            if hasattr(p, ATTR):
                delattr(p, ATTR)
        for module, name, whole in shared:
            module._parameters[name] = whole


def _stand_in_shares(model: nn.Module, autoep_size: int, shard_size: int) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Each expert weight of `model` replaced by a meta parameter of one rank's share (E/N experts), marked as
    the engine marks a shared-out weight (zero3.moe.expert_parallel); the replaced weights, to put back. The
    engine's checks of the size, with its errors."""
    layers = find_experts(model)
    check_autoep_size(layers, autoep_size, shard_size, shard_size)
    replaced = []
    for layer in layers:
        share = ExpertShare(layer.num_experts, 0, autoep_size)
        for name in layer.weights:
            whole = layer.module._parameters[name]
            assert whole is not None
            stand_in = nn.Parameter(torch.empty((share.count, *whole.shape[1:]), dtype=whole.dtype, device="meta"),
                                    requires_grad=whole.requires_grad)
            setattr(stand_in, SHARE, share)
            layer.module._parameters[name] = stand_in
            replaced.append((layer.module, name, whole))
    return replaced


def _persistent_gathered_numel(shard: int, world_size: int, settings: EstimateSettings, lean: bool = False) -> int:
    """Mirrors `GatherUnit.gathers_in_place` / `unsharded_nbytes` with the source `lay_out_params` gives the
    persistent unit: a world of one views its shard in place (no copy) unless the shard's home is host memory
    beside a GPU (offload_param on a CUDA engine), which is copied in and gathered like any other unit, or
    it is cast from the masters (`lean`)."""
    has_source = lean or (settings.offload_param != "none" and settings.accelerator != "cpu")
    if shard == 0 or (world_size == 1 and not has_source):
        return 0
    return world_size * shard


def layout_of_count(params: int, world_size: int, settings: EstimateSettings, secondary: int = 1) -> RankLayout:
    """ZeRO-3's formula for `params` parameters: one flat shard, no persistent ones (see the Note)."""
    shard = ShardMesh.geometry(world_size).shard_numel(params)
    kept = 0 if settings.lean else shard  # lean: every parameter is trained, so no 16-bit shard is kept
    in_memory = min(kept, settings.max_in_cpu) if settings.offload_param == "nvme" else kept
    # GradientReducer's own sizing, with no parameter larger than a bucket.
    total = shard * world_size
    capacity = bucket_capacity(total, 0, settings.reduce_bucket_size, world_size)
    slots = slot_count(total, capacity, settings.overlap_comm)
    return RankLayout(
        lp_in_memory=in_memory, lp_on_disk=kept - in_memory, trainable=shard, persistent_gathered=0,
        scratch=capacity * slots, hpz_secondary=world_size // secondary * shard if secondary > 1 else 0,
        shard_group=world_size,
    )


def state_bytes(layout: RankLayout, settings: EstimateSettings) -> dict[str, dict[str, int]]:
    """state -> place ("device", "host", "disk") -> bytes on one rank."""
    # Where each tier keeps its states (zero3.offload.tiers: lay_out_params, optimizer_states, grad_device):
    # the fp32 masters and moments follow offload_optimizer; the reduced gradients stay beside the device
    # except with ZeRO-Offload ("cpu"), where the host steps them; the 16-bit shards follow offload_param.
    optimizer_home = {"none": "device", "cpu": "host", "nvme": "disk"}[settings.offload_optimizer]
    grads_home = _grads_home(settings)
    lp_home = "device" if settings.offload_param == "none" else "host"
    lp_size = settings.compute_dtype.itemsize
    places: dict[str, dict[str, int]] = {state: dict.fromkeys(PLACES, 0) for state in STATES}
    places["lp_params"][lp_home] += layout.lp_in_memory * lp_size
    places["lp_params"]["disk"] += layout.lp_on_disk * lp_size
    if not masters_are_shards(settings.compute_dtype, settings.offload_optimizer, settings.offload_param):
        places["hp_params"][optimizer_home] = layout.trainable * FP32_BYTES
    # Shards made on demand are held only from the backward to the step (zero3.step.grad_shards' Notes):
    # none between steps, which is what these bytes are (`backward_bytes`).
    places["lp_grads"][grads_home] = 0 if _grads_on_demand(layout, settings) else (
        layout.trainable * settings.grad_dtype.itemsize)
    places["optim_states"][optimizer_home] = settings.optimizer_states * layout.trainable * FP32_BYTES
    places["persistent_params"]["device"] = layout.persistent_gathered * lp_size
    places["hpz_secondary"]["device"] = layout.hpz_secondary * lp_size
    places["contiguous_grad_buffer"]["device"] = layout.scratch * settings.comm_dtype.itemsize
    return places


def _grads_home(settings: EstimateSettings) -> str:
    """Where the reduced gradients live: beside the device, except with ZeRO-Offload, where the host steps them."""
    return "host" if settings.offload_optimizer == "cpu" else "device"


def _grads_on_demand(layout: RankLayout, settings: EstimateSettings) -> bool:
    """Whether the engine makes the gradient shards as they land (build's rule; no overlapped host step here)."""
    return made_on_demand(settings.lean, torch.device(settings.accelerator), layout.shard_group == 1,
                          settings.offload_optimizer != "nvme", super_offload=False)


def backward_bytes(layout: RankLayout, settings: EstimateSettings) -> dict[str, int]:
    """Place -> bytes a backward makes and the step drops: the gradient shards made on demand (lean memory
    mode, a CPU device at several ranks), at most all of them (where ZeRO-Offload keeps them: the host; else
    the device)."""
    if not _grads_on_demand(layout, settings):
        return {}
    return {_grads_home(settings): layout.trainable * settings.grad_dtype.itemsize}


@dataclass(frozen=True)
class Estimate:
    """One rank's bytes per state and place; `exact` when computed from a model's layout (else the formula)."""

    params: int
    ranks_per_node: int
    nodes: int
    settings: EstimateSettings
    states: dict[str, dict[str, int]]
    exact: bool
    # Place -> bytes made during a backward and dropped at the step, beside `states` (lean memory mode's
    # gradient shards); a device must hold them too.
    backward_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes

    def on(self, place: str) -> int:
        """This rank's bytes at `place`, scratch included."""
        return sum(places[place] for places in self.states.values())

    def fits(self, device_bytes: int) -> bool:
        return self.on("device") + self.backward_bytes.get("device", 0) <= device_bytes

    def disk_files(self) -> int:
        """Bytes of this rank's tier files: more than the states' on disk, as the optimizer tier keeps two
        generations of its files (DiskOptimizerStates reserves both up front, so a failed step loses nothing)."""
        optimizer = self.states["hp_params"]["disk"] + self.states["optim_states"]["disk"]
        return self.states["lp_params"]["disk"] + 2 * optimizer

    def model_state_bytes(self) -> dict[str, int]:
        """The shape of `engine.model_state_bytes()`: bytes per state wherever they live; scratch beside the total."""
        out = {state: sum(self.states[state].values()) for state in MODEL_STATES}
        out["total"] = sum(out.values())
        out["contiguous_grad_buffer"] = sum(self.states["contiguous_grad_buffer"].values())
        return out

    def report(self, device: str) -> dict[str, dict[str, int]]:
        """The shape of `engine.state_report()` for an engine on `device` ("cuda:0", "cpu"), places with no
        bytes left out (but the place of gradient shards made on demand): host memory is "cpu" and disk
        "nvme", as the engine names them."""
        names = {"device": device, "host": "cpu", "disk": "nvme"}
        out: dict[str, dict[str, int]] = {}
        for state in REPORTED_STATES:
            where: dict[str, int] = {}
            for place, nbytes in self.states[state].items():
                if nbytes:
                    where[names[place]] = where.get(names[place], 0) + nbytes
            if state == "lp_grads" and not where and any(self.backward_bytes.values()):
                # Shards made on demand hold nothing between steps, and the report names their place with
                # 0 bytes (zero3.offload.manager's [Note: states that hold no memory now]).
                where[names[_grads_home(self.settings)]] = 0
            out[state] = where
        return out

    def as_dict(self, device_bytes: int | None = None) -> dict[str, Any]:
        totals = {place: self.on(place) for place in PLACES}
        out: dict[str, Any] = {
            "params": self.params,
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "nodes": self.nodes,
            "exact": self.exact,
            "settings": asdict(self.settings),
            "per_rank": {**self.states, "total": totals},
            "model_state_bytes": self.model_state_bytes(),
            "per_node": {place: totals[place] * self.ranks_per_node for place in PLACES},
            "disk_files_per_rank": self.disk_files(),
            "backward_per_rank": {place: self.backward_bytes.get(place, 0) for place in PLACES},
        }
        if device_bytes is not None:
            out["device_memory"] = device_bytes
            out["fits"] = self.fits(device_bytes)
            out["largest_params_that_fit"] = largest_fitting_params(
                device_bytes, self.ranks_per_node, self.nodes, self.settings
            )
        return out

    def to_json(self, device_bytes: int | None = None) -> str:
        return json.dumps(self.as_dict(device_bytes), indent=2)


def estimate(
    *,
    params: int | None = None,
    model: nn.Module | None = None,
    ranks_per_node: int = 1,
    nodes: int = 1,
    settings: EstimateSettings | None = None,
) -> Estimate:
    """One rank's bytes per state and place, for a model (exact) or a parameter count (the formula)."""
    settings = settings if settings is not None else EstimateSettings()
    for name, value in (("ranks_per_node", ranks_per_node), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} {value!r}: expected a whole number >= 1")
    world = settings.shard_group_size(ranks_per_node * nodes)  # the ranks each state is split over
    secondary = settings.secondary_group_size(world, ranks_per_node)
    if (params is None) == (model is None):
        raise ValueError("give exactly one of params (a parameter count) and model")
    if settings.autoep_size > 1:
        if model is None:
            raise ValueError(f"autoep_size {settings.autoep_size}: expert parallelism lays out a model's experts; "
                             "give the model, not a parameter count")
        try:  # the engine's rule for the groups, with its error
            expert_group_size(settings.autoep_size, ranks_per_node * nodes, ranks_per_node,
                              world if world < ranks_per_node * nodes else None)
        except TopologyError as error:
            raise ValueError(str(error)) from None
    if model is not None:
        count = sum(p.numel() for p in model.parameters())
        layout = layout_of_model(model, world, settings, secondary)
    else:
        assert params is not None
        if isinstance(params, bool) or not isinstance(params, int) or params < 1:
            raise ValueError(f"params {params!r}: expected a whole number of parameters >= 1")
        count = params
        layout = layout_of_count(params, world, settings, secondary)
    return Estimate(count, ranks_per_node, nodes, settings, state_bytes(layout, settings), exact=model is not None,
                    backward_bytes=backward_bytes(layout, settings))


def largest_fitting_params(
    device_bytes: int, ranks_per_node: int, nodes: int, settings: EstimateSettings
) -> int | None:
    """The most parameters whose formula estimate fits `device_bytes` per rank. None when any model fits: with
    the optimizer on the host and the parameters off the device, the device holds only the scratch bucket,
    which stops growing at reduce_bucket_size."""

    def fits(count: int) -> bool:
        one = estimate(params=count, ranks_per_node=ranks_per_node, nodes=nodes, settings=settings)
        return one.fits(device_bytes)

    if fits(10**18):  # beyond any model: the device holds a constant
        return None
    low, high = 0, 1  # fits(low) (no model fits trivially), not fits(high) once found
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


# ------------------------------------------------------------------ models without data


def meta_gpt(n_layer: int, n_embd: int, vocab_size: int, block_size: int) -> nn.Module:
    """The built-in GPT of this shape on the meta device (the head count does not change any parameter)."""
    from zero3.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=1, n_embd=n_embd)
    with torch.device("meta"):
        return GPT(config)


def meta_hf_model(config_path: str | Path) -> nn.Module:
    """A Hugging Face causal LM built from its config.json (a file, or a directory holding one) on the
    meta device: no weights are read or downloaded."""
    path = Path(config_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"Hugging Face config {str(config_path)!r}: no such file (expected a config.json)")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ValueError(
            "building a model from a Hugging Face config needs transformers (pip install transformers); "
            "without it, give the parameter count instead (--params)"
        ) from None
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, ImportError) as error:  # unreadable, unknown type, missing extra
        raise ValueError(f"Hugging Face config {str(path)!r}: {error}") from None


# ------------------------------------------------------------------ parsing command-line values

_COUNT_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_UNITS = {
    "": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def _scaled(text: str, units: dict[str, int]) -> int | None:
    """`text` as a whole number: a decimal (1.3e9, 1_300_000_000) times a unit of `units`; None if it is not."""
    cleaned = text.strip().replace(",", "").replace(" ", "").upper()
    unit = next((u for u in sorted(units, key=len, reverse=True) if u and cleaned.endswith(u)), "")
    number = cleaned[: len(cleaned) - len(unit)]
    try:
        value = Decimal(number) * units[unit]
        if not value.is_finite() or value != value.to_integral_value():
            return None
        return int(value)
    except ArithmeticError:  # not a number (decimal.InvalidOperation), or an exponent beyond any size
        return None


def parse_count(text: str) -> int:
    """'1.3e9', '1300000000', '1.3B', '350M' -> a positive whole number."""
    value = _scaled(text, _COUNT_SUFFIXES)
    if value is None or value < 1:
        raise ValueError(f"{text!r}: expected a positive whole number, such as 1.3e9, 1300000000 or 1.3B")
    return value


def parse_numel(text: str) -> int:
    """As `parse_count`, with 0 allowed."""
    value = _scaled(text, _COUNT_SUFFIXES)
    if value is None or value < 0:
        raise ValueError(f"{text!r}: expected a whole number >= 0, such as 1e9, 1000000000 or 1B")
    return value


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB' (10^9), '81920MiB', '85899345920' -> a positive byte count."""
    value = _scaled(text, _BYTE_UNITS)
    if value is None or value < 1:
        raise ValueError(f"{text!r}: expected a positive size such as 80GiB, 80GB (10^9 bytes) or 85899345920")
    return value


def parse_gpt_shape(text: str) -> tuple[int, int, int, int]:
    """'LAYERS,EMBD,VOCAB,BLOCK' -> four positive whole numbers."""
    parts = text.split(",")
    try:
        values = tuple(int(part) for part in parts)
    except ValueError:
        values = ()
    if len(values) != 4 or any(value < 1 for value in values):
        raise ValueError(
            f"{text!r}: expected four positive whole numbers LAYERS,EMBD,VOCAB,BLOCK, such as 12,768,50304,1024"
        )
    return cast(tuple[int, int, int, int], values)
