"""One topology (zero3.topology): the nodes from torchrun's environment, every engine group made in one
place, none of them the default group.

The layout checks are judged against the numbers given; the groups against torch's own record of them;
the default-group case by a model whose forward runs its own all-reduce on the default group while the
ranks route through different parameters (with the engine's gathers on the default group too, the two
would pair with each other's collectives and the job would hang).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zero3
from tests import models
from tests.distributed import run_ranks
from tests.test_divergent import MICRO, config
from zero3.topology import NodeLayout, Topology, TopologyError


# ---- the layout from the environment (no collectives) ------------------------------------------------
def test_nodes_of_equal_size_in_rank_order() -> None:
    views = [(2, 0), (2, 0), (2, 1), (2, 1)]
    layouts = [NodeLayout.agreed(views, rank) for rank in range(4)]
    assert [(n.num_nodes, n.ranks_per_node, n.node_rank, n.local_rank) for n in layouts] == [
        (2, 2, 0, 0), (2, 2, 0, 1), (2, 2, 1, 0), (2, 2, 1, 1)]


def test_ranks_per_node_that_differ_are_named() -> None:
    with pytest.raises(TopologyError, match=r"LOCAL_WORLD_SIZE differs between ranks \(2 on ranks 0-1; 3 on ranks 2-4\)"):
        NodeLayout.agreed([(2, 0), (2, 0), (3, 1), (3, 1), (3, 1)], 0)


def test_a_node_size_that_does_not_divide_the_world_is_named() -> None:
    with pytest.raises(TopologyError, match="LOCAL_WORLD_SIZE=2 does not divide the world size 3"):
        NodeLayout.agreed([(2, 0), (2, 0), (2, 1)], 0)


def test_a_node_whose_ranks_are_not_consecutive_is_named() -> None:
    with pytest.raises(TopologyError, match="rank 1 says it is on node GROUP_RANK=1.*would be on node 0"):
        NodeLayout.agreed([(2, 0), (2, 1), (2, 0), (2, 1)], 0)


def test_a_group_rank_that_is_not_a_number_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUP_RANK", "first")
    with pytest.raises(TopologyError, match="GROUP_RANK='first' on rank 0: expected a whole number"):
        NodeLayout.own_view(0, 1)


# ---- the groups, at 4 ranks as 2 nodes of 2 ----------------------------------------------------------
def _as_two_nodes(rank: int) -> None:
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))


def _groups(rank: int, world: int, mesh_shape: tuple[int, ...] | None) -> dict:
    _as_two_nodes(rank)
    zero3.init_distributed()
    mesh = init_device_mesh("cpu", mesh_shape) if mesh_shape else None
    engine, *_ = zero3.initialize(model=torch.nn.Linear(8, 8), config=config(), mesh=mesh)
    topology = engine.comm.topology
    default = dist.distributed_c10d._get_default_group()
    groups = {
        "gather": topology.gather_group, "reduce": topology.reduce_group,
        **({"replicate": topology.replicate_group} if engine.mesh.replicate_size > 1 else {}),
        "control": topology.control_group, "job": topology.job_group, "checkpoint": topology.checkpoint_group(),
        "host_shard": topology.host_shard_group,
    }
    result = {
        "nodes": topology.nodes,
        "default_used": [name for name, group in groups.items() if group is default or group is None],
        "ranks": {name: dist.get_process_group_ranks(group) for name, group in groups.items()},
        "backends": {name: dist.get_backend(group) for name, group in groups.items()},
        "shard": (engine.mesh.shard_size, engine.mesh.shard_rank, engine.mesh.replicate_size,
                  engine.mesh.replicate_rank),
    }
    engine.destroy()
    return result


@pytest.mark.parametrize("mesh_shape", [None, (4,), (2, 2)], ids=["config", "mesh-1d", "mesh-2d"])
def test_every_engine_group_is_its_own_and_none_is_the_default_group(mesh_shape: tuple[int, ...] | None) -> None:
    results = run_ranks(4, _groups, mesh_shape)
    replicas = 2 if mesh_shape == (2, 2) else 1
    shard_size = 4 // replicas
    for rank, r in enumerate(results):
        assert r["default_used"] == []
        assert (r["nodes"].num_nodes, r["nodes"].ranks_per_node, r["nodes"].node_rank) == (2, 2, rank // 2)
        replica, shard_rank = divmod(rank, shard_size)
        assert r["shard"] == (shard_size, shard_rank, replicas, replica)
        shard_ranks = list(range(replica * shard_size, (replica + 1) * shard_size))
        assert r["ranks"]["gather"] == r["ranks"]["reduce"] == r["ranks"]["host_shard"] == shard_ranks
        if replicas > 1:
            assert r["ranks"]["replicate"] == list(range(shard_rank, 4, shard_size))
        else:
            assert r["shard"][2] == 1  # one replica: no replicate group (nothing to sum across)
        assert r["ranks"]["control"] == r["ranks"]["job"] == r["ranks"]["checkpoint"] == [0, 1, 2, 3]
        assert r["backends"]["control"] == r["backends"]["checkpoint"] == "gloo"


def _bad_node_view(rank: int, world: int) -> str:
    os.environ.update(LOCAL_WORLD_SIZE="2" if rank == 0 else "1", GROUP_RANK="0" if rank == 0 else "1")
    zero3.init_distributed()
    try:
        zero3.initialize(model=torch.nn.Linear(8, 8), config=config())
    except TopologyError as error:
        return str(error)
    return "no error"


def test_nodes_that_disagree_fail_on_every_rank_before_anything_is_partitioned() -> None:
    results = run_ranks(2, _bad_node_view)
    assert results[0] == results[1]
    assert "LOCAL_WORLD_SIZE differs between ranks (1 on ranks 1; 2 on ranks 0)" in results[0]


def _bad_mesh(rank: int, world: int, kind: str) -> str:
    zero3.init_distributed()
    mesh = {"3d": lambda: init_device_mesh("cpu", (1, 1, 2)),
            "object": lambda: "2x1"}[kind]()
    try:
        zero3.initialize(model=torch.nn.Linear(8, 8), config=config(), mesh=mesh)
    except TopologyError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(("kind", "expected"), [
    ("3d", "expected 1 dimension (shard) or 2 (replicate, shard), got 3"),
    ("object", "mesh='2x1': expected a torch.distributed.device_mesh.DeviceMesh"),
])
def test_a_mesh_the_engine_cannot_use_is_refused_on_every_rank(kind: str, expected: str) -> None:
    results = run_ranks(2, _bad_mesh, kind)
    assert all(expected in found for found in results), results


# ---- no engine collective on the default group -------------------------------------------------------
_WATCHED = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "gather_object", "broadcast_object_list",
            "barrier", "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "scatter_object_list")


def _record_default_group_uses(rank: int, world: int, tmp: str) -> list[str]:
    import zero3.comm as zero3_comm

    zero3.init_distributed()
    default = dist.distributed_c10d._get_default_group()
    seen: list[str] = []
    watching = [False]

    def watched(name: str, function):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            group = kwargs.get("group", kwargs.get("process_group"))
            if watching[0] and (group is None or group is default):
                seen.append(name)
            return function(*args, **kwargs)
        return call

    for name in _WATCHED:
        if hasattr(dist, name):
            setattr(dist, name, watched(name, getattr(dist, name)))
    for name in ("_all_gather_flat", "_reduce_scatter_flat"):
        setattr(zero3_comm, name, watched(name, getattr(zero3_comm, name)))
    torch.manual_seed(0)
    model = models.Routed()
    engine, *_ = zero3.initialize(model=model, config=config())
    watching[0] = True
    for x, y in models.batches("x8", 2, MICRO * world):
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(tmp, tag="sync")
    engine.save_checkpoint(tmp, tag="async", async_save=True)
    engine.wait_for_checkpoint()
    engine.load_checkpoint(tmp, tag="sync")
    engine.offload_states()
    engine.reload_states()
    with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):
        pass
    for _name, _value in engine.iter_full_params():
        pass
    watching[0] = False
    engine.destroy()
    return seen


def test_no_engine_collective_runs_on_the_default_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Training on different routes, saves (blocking and async), a load, parking, a modifier: every collective
    the engine issues names a group of its own (with the gathers on the default group, a model's own
    collective there could pair with another rank's prefetch)."""
    assert run_ranks(2, _record_default_group_uses, str(tmp_path)) == [[], []]


def _expert_groups(rank: int, world: int, size: int) -> dict:
    _as_two_nodes(rank)
    zero3.init_distributed()
    topology = Topology.build(torch.device("cpu"), expert_parallel_size=size)
    default = dist.distributed_c10d._get_default_group()
    result = {
        "experts": (topology.experts.shard_size, topology.experts.shard_rank,
                    dist.get_process_group_ranks(topology.experts.shard_group)),
        "expert_data": (topology.expert_data.shard_size, topology.expert_data.shard_rank,
                        dist.get_process_group_ranks(topology.expert_data.shard_group)),
        "own_groups": all(g is not default for g in (topology.experts.shard_group, topology.expert_data.shard_group)),
    }
    topology.close()
    return result


@pytest.mark.parametrize("size", [2, 4])
def test_expert_parallel_groups_are_consecutive_ranks_inside_a_node_first(size: int) -> None:
    """At 4 ranks as 2 nodes of 2: `autoep_size` 2 is one group per node, the expert-data groups across the
    nodes; 4 spans both nodes, each expert-data group a rank alone."""
    for rank, r in enumerate(run_ranks(4, _expert_groups, size)):
        group, place = divmod(rank, size)
        assert r["experts"] == (size, place, list(range(group * size, (group + 1) * size))), r
        assert r["expert_data"] == (4 // size, group, list(range(place, 4, size))), r
        assert r["own_groups"]


def test_an_expert_parallel_size_that_does_not_fit_the_nodes_is_refused() -> None:
    from zero3.shard_mesh import expert_group_size

    with pytest.raises(TopologyError, match=r"autoep_size=3 does not divide the world size 4"):
        expert_group_size(3, 4, 2)
    with pytest.raises(TopologyError, match=r"autoep_size=4 neither divides a node's 6 ranks nor spans whole nodes"):
        expert_group_size(4, 12, 6)
    assert expert_group_size(4, 8, 2) == 4 and expert_group_size(2, 8, 4) == 2
