"""The mesh type and the one collectives module (zero3.shard_mesh.ShardMesh, zero3.partition.collectives).

Checked against plain arithmetic on the ranks' inputs: the geometry against the padded split,
the gather against the concatenated shards, the reduction against the sum over every rank
(shard group and replicas), and the codec slot against its own encode/decode round trip.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed import run_ranks
from zero3.comm import Communicator
from zero3.partition.collectives import GradReduce, ParamGather
from zero3.shard_mesh import ShardMesh
from zero3.topology import Topology

ROOT = Path(__file__).resolve().parent.parent / "zero3"


@pytest.mark.parametrize("numel,size", [(10, 1), (10, 3), (7, 4), (3, 4), (0, 2), (12, 4)])
def test_geometry_is_the_padded_split(numel: int, size: int) -> None:
    flat = torch.arange(numel)
    padded = torch.cat([flat, torch.full((-(-numel // size) * size - numel,), -1)])
    for rank in range(size):
        mesh = ShardMesh.geometry(size, rank)
        start, end = mesh.shard_range(numel)
        shard = padded.chunk(size)[rank] if numel else torch.empty(0, dtype=flat.dtype)
        assert mesh.shard_numel(numel) == shard.numel()
        assert torch.equal(flat[start:end], shard[shard >= 0])


def test_a_mesh_refuses_a_rank_outside_its_group() -> None:
    with pytest.raises(ValueError, match="shard rank 2 outside a shard group of size 2"):
        ShardMesh.geometry(2, 2)
    with pytest.raises(ValueError, match="replicate rank 1 outside a replicate group of size 1"):
        ShardMesh(shard_size=2, shard_rank=0, replicate_rank=1)


class CastCodec:
    """A stand-in for a quantizer: what travels is the shard rounded to bf16."""

    def encoded_numel(self, shard_numel: int) -> int:
        return shard_numel

    def encoded_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16

    def encode(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(shard)

    def decode(self, gathered: torch.Tensor, out: torch.Tensor, ranks: int) -> None:
        out.copy_(gathered)


def _gathers(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    mesh = ShardMesh.of_group()
    comm = Communicator()
    gather = ParamGather(mesh, comm)
    shard = torch.randn(5, generator=torch.Generator().manual_seed(rank)) / 3
    own_place = torch.empty(world * 5)
    own_place[rank * 5 : rank * 5 + 5].copy_(shard)
    coded = ParamGather(mesh, comm, CastCodec())
    # Two parameters of 2 and 3 shard elements each in one unit: copy-out lays each one out whole.
    laid_out = gather.copy_out(gather.gather(shard), [2, 3])
    one_dim = ShardMesh.from_device_mesh(init_device_mesh("cpu", (world,)))
    return {
        "mesh": (mesh.shard_size, mesh.shard_rank, mesh.replicate_size),
        "one_dim": (one_dim.shard_size, one_dim.shard_rank, one_dim.replicate_size, one_dim.world_size),
        "plain": gather.gather(shard),
        "in_place": gather.gather(own_place[rank * 5 : rank * 5 + 5], own_place),
        "coded": coded.gather(shard),
        "exact": coded.exact().gather(shard),
        "laid_out": laid_out,
        "shard": shard,
    }


def test_the_parameter_gather_plain_in_place_coded_and_laid_out() -> None:
    results = run_ranks(2, _gathers)
    shards = [r["shard"] for r in results]
    whole = torch.cat(shards)
    for rank, r in enumerate(results):
        assert r["mesh"] == (2, rank, 1)
        assert r["one_dim"] == (2, rank, 1, 2)
        assert torch.equal(r["plain"], whole)
        assert torch.equal(r["in_place"], whole)
        assert torch.equal(r["exact"], whole)
        assert torch.equal(r["coded"], torch.cat([s.to(torch.bfloat16).float() for s in shards]))
        assert not torch.equal(r["coded"], whole)  # the codec ran: bf16 rounding is visible
        # parameter 0 = both ranks' first 2 elements, parameter 1 = their last 3
        expected = torch.cat([shards[0][:2], shards[1][:2], shards[0][2:], shards[1][2:]])
        assert torch.equal(r["laid_out"], expected)


def _reduces_with_replicas(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    topology = Topology.build(torch.device("cpu"), mesh=device_mesh)
    mesh = topology.shard
    reduce = GradReduce(mesh, Communicator(topology))
    full = torch.arange(8, dtype=torch.float32) * (rank + 1)  # this rank's whole gradient (padded)
    output = reduce.own_chunk(full, 4)
    work = reduce.start(output, full)
    if work is not None:
        work.wait()
    reduce.comm.all_reduce_replicas(output)
    return {"coords": (mesh.shard_size, mesh.shard_rank, mesh.replicate_size, mesh.replicate_rank),
            "shard": output.clone(), "world": mesh.world_size}


def test_the_gradient_reduction_sums_over_the_shard_group_and_the_replicas() -> None:
    results = run_ranks(4, _reduces_with_replicas)
    total = sum(torch.arange(8, dtype=torch.float32) * (rank + 1) for rank in range(4))
    for rank, r in enumerate(results):
        shard_size, shard_rank, replicate_size, replicate_rank = r["coords"]
        # init_device_mesh lays ranks out row-major: rank = replicate_rank * 2 + shard_rank
        assert (shard_size, replicate_size, r["world"]) == (2, 2, 4)
        assert (replicate_rank, shard_rank) == divmod(rank, 2)
        assert torch.equal(r["shard"], total[shard_rank * 4 : shard_rank * 4 + 4])


def _calls(path: Path, name: str) -> int:
    tree = ast.parse(path.read_text())
    return sum(
        1 for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
    )


@pytest.mark.parametrize("collective", ["all_gather_flat", "reduce_scatter_flat"])
def test_one_module_issues_every_parameter_gather_and_gradient_reduction(collective: str) -> None:
    callers = {
        str(path.relative_to(ROOT)): n
        for path in ROOT.rglob("*.py")
        if path.name != "comm.py" and (n := _calls(path, collective))
    }
    assert set(callers) == {"partition/collectives.py"}, callers
