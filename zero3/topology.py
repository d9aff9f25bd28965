"""Where each rank sits in the job, and every process group the engine uses.

The geometry those groups carry (`ShardMesh`, and the group sizes MiCS, hpZ
and qgZ allow) is zero3.shard_mesh's; the default group, joined before any
of these is made, is zero3.default_group's.

[Note: one topology]
Every engine collective runs on a group made here, in one place, and none on
the default group. A model's own collective on the default group (expert- or
tensor-parallel code in its forward) would otherwise pair with another rank's
parameter gather whenever the ranks take different routes through the model,
and both would wait forever. (Separate groups keep each sequence paired; they
do not let a rank blocked in the model's own collective issue a gather
another rank waits on: zero3.passes.gather_walk's [Note: lockstep gathers]
says what a model's collectives must do.) Which collective runs on which
group: [Note: the engine's groups] below.

The shard and replicate groups are the dimensions of torch's `DeviceMesh`,
(replicate, shard) as FSDP2's HSDP lays them out: built here by
`init_device_mesh` with every dimension on a group of its own (a backend
override; without one, torch hands a dimension that spans the job the
default group). A mesh the user gives (`zero3.initialize(..., mesh=...)`,
FSDP2's way: 1-D shards, 2-D is (replicate, shard)) gives the layout; the
groups are still made here, over the same ranks, so that none is the default
group and each has the engine's timeout.

The nodes come from torchrun's environment: LOCAL_WORLD_SIZE ranks on each
node, GROUP_RANK the node's index. Every rank's view is exchanged before
anything else is made, so a job whose nodes disagree fails on every rank
with the numbers, before any parameter is partitioned.

[Note: the engine's groups]
A collective sequence must match only within a group, so collectives whose
order or timing differs between ranks get a group of their own:

* `gather_group`: the shard group's parameter all-gathers, in the order of
  the lockstep gather walk (zero3.passes.gather_walk), which every rank
  issues identically; the step's norm sum too.
* `reduce_group`: the same ranks, for gradient reduce-scatters, which run in
  a canonical bucket order but start when each rank's backward reaches
  them, so they get one of their own.
* `replicate_group`: the ranks holding the same shard in other replicas
  (HSDP, MiCS), which all-reduce the reduced gradient shards once a step
  (zero3.comm's [Note: the replicas' sum, once a step]).
* `control_group`: gloo, the whole job: the walk's markers, the step's
  flags and every agreement (one rank's failure, the step's commit), small
  host tensors, so reading one never waits on an accelerator and one rank's
  failure reaches every replica; a blocking save and a load run DCP on it.
* `job_group`: the whole job on the device's backend (what must reach every
  replica, as zero3.Init's broadcast of a new module's values).
* `checkpoint_group()`: gloo, the whole job, for an async save's writes,
  which run while training goes on (made at the first async save).
* `secondary_group`: hpZ's (`zero_hpz_partition_size: K`), K consecutive
  ranks of one node and one shard group, which gather the secondary shards
  a forward left behind (zero3.partition.secondary) in the backward, so its
  gathers never leave the node.
* `grads_inside`, `grads_across`: qgZ's (`zero_quantized_gradients`): the
  shard group cut by node, the ranks of one node, and the ranks at the same
  place on each node. A gradient reduction is an all-to-all inside the
  node, then one across (zero3.partition.collectives' `QuantizedGradReduce`).
* `experts`, `expert_data`: expert parallelism's (`expert_parallel.autoep_size`:
  N), N consecutive ranks (inside a node, or over whole nodes) that share a
  layer's experts out and send each other tokens (zero3.moe.dispatch), and
  the ranks at the same place in each such group, which shard an expert's
  state and reduce its gradients (inside one shard group where the dense
  part's shards have replicas: the experts' replicas are then the dense part's).
* `host_shard_group`, `host_replicate_group`: gloo over the shard and the
  replicate group, for host tensors beside an accelerator (Muon's all-to-all
  and the replicas' gradient sum under ZeRO-Offload); the groups above where
  those are gloo already.

A `Communicator` (zero3.comm) issues all of these but Muon's all-to-all and
DCP's own. Without a topology (zero3.Init, before an engine exists) it runs
every collective on the default group, as DeepSpeed's zero.Init does.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zero3 import accelerator
from zero3.shard_mesh import (
    ShardMesh, TopologyError, expert_group_size, hpz_group_size, mics_group_size, qgz_inside_size,
)

REPLICATE, SHARD = "replicate", "shard"  # the mesh's dimension names, FSDP2's HSDP order
HPZ_OUTER, HPZ = "hpz_groups", "hpz"  # hpZ's secondary mesh: (groups, ranks in a group)
QGZ_ACROSS, QGZ_INSIDE = "qgz_across", "qgz_inside"  # qgZ's mesh over a shard group: (nodes, ranks of a node)
EXPERT_DATA, EXPERT = "expert_data", "expert"  # expert parallelism's mesh: (expert-parallel groups, ranks in one)
EXPERT_REPLICATE = "expert_replicate"  # its replicas' dimension, where the dense part's shards have replicas


@dataclass(frozen=True)
class NodeLayout:
    """The job's nodes as torchrun lays ranks out: node g holds ranks [g*L, (g+1)*L) of L per node."""

    ranks_per_node: int
    num_nodes: int
    node_rank: int  # this rank's node (torchrun's GROUP_RANK)
    local_rank: int  # this rank within its node

    @staticmethod
    def own_view(rank: int, world_size: int) -> tuple[int, int]:
        """(ranks per node, node) as this rank's environment tells it: torchrun's LOCAL_WORLD_SIZE and
        GROUP_RANK; without them (a plain `python train.py`, an MPI launch) the job is one node."""
        def number(name: str, default: int) -> int:
            text = os.environ.get(name)
            if text is None:
                return default
            try:
                return int(text)
            except ValueError:
                raise TopologyError(f"{name}={text!r} on rank {rank}: expected a whole number (torchrun sets it)") from None

        return number("LOCAL_WORLD_SIZE", world_size), number("GROUP_RANK", 0)

    @classmethod
    def agreed(cls, views: list[tuple[int, int]], rank: int) -> NodeLayout:
        """The layout every rank's view (ranks per node, node), in job-rank order, describes; a
        `TopologyError` naming the numbers where they do not describe one layout."""
        world_size = len(views)
        sizes = sorted({size for size, _ in views})
        if len(sizes) > 1:
            by_size = {size: [r for r, (s, _) in enumerate(views) if s == size] for size in sizes}
            raise TopologyError(
                "LOCAL_WORLD_SIZE differs between ranks (" + "; ".join(
                    f"{size} on ranks {_spans(ranks)}" for size, ranks in by_size.items()
                ) + "): zero3 needs the same number of ranks on every node (torchrun --nproc-per-node)"
            )
        per_node = sizes[0]
        if per_node < 1 or world_size % per_node:
            raise TopologyError(
                f"LOCAL_WORLD_SIZE={per_node} does not divide the world size {world_size}: expected the same "
                "number of ranks on every node"
            )
        for job_rank, (_, node) in enumerate(views):
            if node != job_rank // per_node:
                raise TopologyError(
                    f"rank {job_rank} says it is on node GROUP_RANK={node}, but with {per_node} ranks per node "
                    f"it would be on node {job_rank // per_node}: expected each node's ranks to be consecutive "
                    "(as torchrun numbers them)"
                )
        return cls(ranks_per_node=per_node, num_nodes=world_size // per_node, node_rank=rank // per_node,
                   local_rank=rank % per_node)


def _spans(ranks: list[int]) -> str:
    """Ranks as compact spans: [0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def _backend_options(backend: str, timeout: datetime.timedelta | None) -> tuple[str, object] | str:
    """A DeviceMesh backend override that gives each dimension a group of its own, with `timeout`."""
    if timeout is None:
        return backend
    options: object
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    else:
        return backend  # another backend keeps its own default timeout
    options._timeout = timeout  # type: ignore[attr-defined]
    return backend, options


@dataclass
class Topology:
    """This rank's place in the job and the engine's process groups (see the Notes above)."""

    rank: int
    world_size: int
    nodes: NodeLayout
    device_mesh: DeviceMesh | None  # (replicate, shard), or (shard,) with one replica; None in a world of one
    shard: ShardMesh  # the shard and replicate coordinates, with their groups
    reduce_group: dist.ProcessGroup | None
    control_group: dist.ProcessGroup | None
    job_group: dist.ProcessGroup | None
    host_shard_group: dist.ProcessGroup | None
    host_replicate_group: dist.ProcessGroup | None
    timeout: datetime.timedelta | None
    # hpZ's secondary coordinates (size K, this rank's place) and group; None when hpZ is off.
    secondary: ShardMesh | None = None
    # qgZ's two groups over the shard group ([Note: the engine's groups]); None without zero_quantized_gradients.
    grads_inside: ShardMesh | None = None
    grads_across: ShardMesh | None = None
    # Expert parallelism's groups: `experts`, the ranks that share a layer's experts out (each owns a whole
    # share); `expert_data`, the ranks at the same place in each such group, over which an expert's state is
    # sharded and its gradients reduced. None without expert parallelism.
    experts: ShardMesh | None = None
    expert_data: ShardMesh | None = None
    _made: list[dist.ProcessGroup] = field(default_factory=list)  # destroyed by `close`
    _checkpoint_group: dist.ProcessGroup | None = None

    @property
    def gather_group(self) -> dist.ProcessGroup | None:
        return self.shard.shard_group

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        return self.shard.replicate_group

    @property
    def secondary_group(self) -> dist.ProcessGroup | None:
        return self.secondary.shard_group if self.secondary is not None else None

    @classmethod
    def build(cls, device: torch.device, timeout: datetime.timedelta | None = None,
              mesh: DeviceMesh | None = None, mics_shard_size: int = -1, hpz_partition_size: int = 1,
              quantized_gradients: bool = False, expert_parallel_size: int = 1) -> Topology:
        """The topology of the whole job (collective: every rank calls it at the same point).

        `mesh`: the user's DeviceMesh: 1-D shards over its one dimension, 2-D is (replicate, shard).
        `mics_shard_size` (the config's): shard groups of that many consecutive ranks, replicas across
        them (-1: off). Without either, every rank shards (plain ZeRO-3), on groups made here.
        `hpz_partition_size` (the config's `zero_hpz_partition_size`): hpZ's secondary groups of that many
        consecutive ranks (1 or 0: off). `quantized_gradients` (`zero_quantized_gradients`): qgZ's groups.
        `expert_parallel_size` (`expert_parallel.autoep_size`; 1: off): expert parallelism's groups."""
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if world_size == 1:
            _shape(mesh, mics_shard_size, world_size)  # a bad mesh or size is an error at any world size
            nodes = NodeLayout.agreed([NodeLayout.own_view(rank, world_size)], 0)
            hpz_group_size(hpz_partition_size, 1, 1)
            expert_group_size(expert_parallel_size, 1, 1)
            return cls(rank, 1, nodes, None, ShardMesh.geometry(1), None, None, None, None, None, timeout)
        made: list[dist.ProcessGroup] = []
        control = dist.new_group(backend="gloo", timeout=timeout)  # before anything can fail on one rank only
        made.append(control)
        try:
            own: tuple[int, int] = (0, 0)
            shape = (1, world_size)
            try:
                own = NodeLayout.own_view(rank, world_size)
                shape = _shape(mesh, mics_shard_size, world_size)
                expert_group_size(expert_parallel_size, world_size, own[0], shape[1] if shape[0] > 1 else None)
                failure = None
            except TopologyError as error:
                failure = str(error)
            seen: list[tuple[tuple[int, int], str | None]] = [(own, None)] * world_size
            dist.all_gather_object(seen, (own, failure), group=control)
            failures = sorted({why for _, why in seen if why is not None})
            if failures:
                raise TopologyError("; ".join(failures))
            nodes = NodeLayout.agreed([view for view, _ in seen], rank)
            secondary_size = hpz_group_size(hpz_partition_size, shape[1], nodes.ranks_per_node)
            inside_size = qgz_inside_size(shape[1], nodes.ranks_per_node) if quantized_gradients else 0
            backend = accelerator.communication_backend(device)
            override = _backend_options(backend, timeout)
            job = dist.new_group(backend=backend, timeout=timeout)
            made.append(job)

            def mesh_of_own_groups(backend_override: tuple[str, object] | str = override) -> DeviceMesh:
                # One replica: a 1-D mesh (a 2-D one would make a group of one per rank, each a collective call).
                replicas, shard_size = shape
                made_mesh = init_device_mesh(
                    device.type, (shard_size,), mesh_dim_names=(SHARD,), backend_override={SHARD: backend_override},
                ) if replicas == 1 else init_device_mesh(
                    device.type, shape, mesh_dim_names=(REPLICATE, SHARD),
                    backend_override={REPLICATE: backend_override, SHARD: backend_override},
                )
                made.extend(made_mesh.get_all_groups())
                return made_mesh

            device_mesh = mesh_of_own_groups()
            shard = ShardMesh.from_device_mesh(device_mesh)
            # The reduce-scatters' own groups over the same shard ranks: a second mesh of the same shape
            # (its replicate groups go unused: the first mesh's carry the replicas' all-reduce).
            reduce_group = mesh_of_own_groups().get_group(SHARD)
            host_mesh = device_mesh if backend == "gloo" else mesh_of_own_groups(_backend_options("gloo", timeout))
            host_shard_group = host_mesh.get_group(SHARD)
            host_replicate_group = host_mesh.get_group(REPLICATE) if host_mesh.ndim == 2 else None
            secondary = None
            if secondary_size > 1:
                # (secondary groups, K): each row K consecutive ranks, inside one node and one shard group.
                secondary_mesh = init_device_mesh(
                    device.type, (world_size // secondary_size, secondary_size),
                    mesh_dim_names=(HPZ_OUTER, HPZ), backend_override={HPZ_OUTER: override, HPZ: override},
                )
                made.extend(secondary_mesh.get_all_groups())
                secondary = ShardMesh(shard_size=secondary_size, shard_rank=secondary_mesh.get_local_rank(HPZ),
                                      shard_group=secondary_mesh.get_group(HPZ))
            grads_inside = grads_across = None
            if inside_size:
                # (replicas, nodes of a shard group, ranks of a node in it), the replicas' dimension only when
                # there are replicas (each dimension is a group per coordinate).
                replicas, shard_size = shape
                dims = (QGZ_ACROSS, QGZ_INSIDE)
                sizes: tuple[int, ...] = (shard_size // inside_size, inside_size)
                if replicas > 1:
                    dims, sizes = (REPLICATE, *dims), (replicas, *sizes)
                grads_mesh = init_device_mesh(device.type, sizes, mesh_dim_names=dims,
                                              backend_override={dim: override for dim in dims})
                made.extend(grads_mesh.get_all_groups())
                grads_inside, grads_across = (
                    ShardMesh(shard_size=grads_mesh.size(grads_mesh.mesh_dim_names.index(dim)),
                              shard_rank=grads_mesh.get_local_rank(dim), shard_group=grads_mesh.get_group(dim))
                    for dim in (QGZ_INSIDE, QGZ_ACROSS)
                )
            experts = expert_data = None
            if expert_parallel_size > 1:
                # (groups, ranks in one): each row consecutive ranks, so a group lies inside a node first. Where
                # the dense part's shards have replicas (MiCS, HSDP), the expert-data groups are cut the same way
                # (replicas, expert-data ranks in one shard group, ranks in an expert-parallel group): an expert
                # share is sharded inside the shard group and replicated across the very replicate groups the
                # dense part's (the replicas' sum, once a step, is then every shard's).
                replicas, shard_size = shape
                dims: tuple[str, ...] = (EXPERT_DATA, EXPERT)
                sizes = (shard_size // expert_parallel_size, expert_parallel_size)
                if replicas > 1:
                    dims, sizes = (EXPERT_REPLICATE, *dims), (replicas, *sizes)
                expert_mesh = init_device_mesh(device.type, sizes, mesh_dim_names=dims,
                                               backend_override={dim: override for dim in dims})
                made.extend(expert_mesh.get_all_groups())

                def along(dim: str, replicas_dim: str | None = None) -> ShardMesh:
                    copies = {} if replicas_dim is None else {
                        "replicate_size": expert_mesh.size(dims.index(replicas_dim)),
                        "replicate_rank": expert_mesh.get_local_rank(replicas_dim),
                        "replicate_group": expert_mesh.get_group(replicas_dim)}
                    return ShardMesh(shard_size=expert_mesh.size(dims.index(dim)),
                                     shard_rank=expert_mesh.get_local_rank(dim), shard_group=expert_mesh.get_group(dim),
                                     **copies)

                experts = along(EXPERT)
                expert_data = along(EXPERT_DATA, EXPERT_REPLICATE if replicas > 1 else None)
        except BaseException:
            for group in made:
                dist.destroy_process_group(group)
            raise
        return cls(rank, world_size, nodes, device_mesh, shard, reduce_group, control, job, host_shard_group,
                   host_replicate_group, timeout, secondary, grads_inside, grads_across, experts, expert_data, made)

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """A gloo group over the whole job for an async save's writes (made on first use: every rank asks
        at the same point, as a save does)."""
        if self.world_size == 1:
            return None
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo", timeout=self.timeout)
            self._made.append(self._checkpoint_group)
        return self._checkpoint_group

    def close(self) -> None:
        """Destroy every group made here (every rank calls this)."""
        made, self._made = self._made, []
        self._checkpoint_group = None
        if dist.is_initialized():
            for group in made:
                dist.destroy_process_group(group)


def _check_mesh(mesh: DeviceMesh | None, world_size: int) -> None:
    if mesh is None:
        return
    if not isinstance(mesh, DeviceMesh):
        raise TopologyError(f"mesh={mesh!r}: expected a torch.distributed.device_mesh.DeviceMesh")
    if mesh.ndim not in (1, 2):
        raise TopologyError(
            f"mesh={mesh}: expected 1 dimension (shard) or 2 (replicate, shard), got {mesh.ndim}"
        )
    if mesh.size() != world_size:
        raise TopologyError(f"mesh={mesh}: it spans {mesh.size()} ranks, the job has {world_size}: expected all")
    ranks = mesh.mesh.reshape(-1).tolist()
    if ranks != list(range(world_size)):
        raise TopologyError(
            f"mesh={mesh}: its ranks in order are {ranks}; expected 0..{world_size - 1} in order "
            "(init_device_mesh's layout: each shard group consecutive ranks, replicas across them)"
        )


def _shape(mesh: DeviceMesh | None, mics_shard_size: int, world_size: int) -> tuple[int, int]:
    """(replicas, shard group size): the user's mesh's, or MiCS's groups, else one replica of the whole
    job; a `TopologyError` naming the numbers where these cannot be."""
    _check_mesh(mesh, world_size)
    shard_size = mics_group_size(mics_shard_size, world_size)
    if mesh is None:
        return world_size // shard_size, shard_size
    shape = (1, mesh.size()) if mesh.ndim == 1 else (mesh.size(0), mesh.size(1))
    if mics_shard_size != -1 and shape[1] != shard_size:
        raise TopologyError(
            f"zero_optimization.mics_shard_size={mics_shard_size} beside a mesh whose shard dimension has "
            f"{shape[1]} ranks: give one of them, or the same size in both"
        )
    return shape
