"""Where each rank sits in the job, and every process group the engine uses.

[Note: one topology]
Every engine collective runs on a group made here, in one place, and none on
the default group. A model's own collective on the default group (expert- or
tensor-parallel code in its forward) would otherwise pair with another rank's
parameter gather whenever the ranks take different routes through the model,
and both would wait forever. (Separate groups keep each sequence paired; they
do not let a rank blocked in the model's own collective issue a gather
another rank waits on: zero3.runtime.gather_walk's [Note: lockstep gathers]
says what a model's collectives must do.) The groups:

* `gather_group`: the shard group's parameter all-gathers, issued in the
  lockstep walk's order (zero3.runtime.gather_walk); the step's norm sum too.
* `reduce_group`: the same ranks, for gradient reduce-scatters, which start
  when each rank's backward reaches them (a sequence must match only within
  a group, so they get one of their own).
* `replicate_group`: the ranks holding the same shard in other replicas
  (HSDP, MiCS), which all-reduce the reduced gradient shards.
* `control_group`: gloo, the whole job: agreements (one rank's failure, the
  step's commit), the walk's markers, DCP's planning in a save or load.
  Small host tensors, so reading one never waits on an accelerator.
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
* `host_shard_group`, `host_replicate_group`: gloo over the shard and the
  replicate group, for host tensors beside an accelerator (Muon's all-to-all
  and the replicas' gradient sum under ZeRO-Offload); the groups above where
  those are gloo already.

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

[Note: shard geometry]
A parameter is split across the ranks of its shard group and, where there is
more than one copy of the model's shards (hierarchical partitioning: FSDP2's
HSDP, DeepSpeed's MiCS and hpZ), replicated across a replicate group. The
code that shards, gathers, reduces and estimates reads this rank's place from
one `ShardMesh`. The geometry is the one DeepSpeed and FSDP2 use: each
flattened parameter is padded to a multiple of the shard group's size and
split into equal shards; shard rank r keeps elements [r*s, (r+1)*s).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zero3 import accelerator


@dataclass(frozen=True)
class ShardMesh:
    """This rank's coordinates: its shard group (size, rank, group) and its replicate group.

    A group of None is the default process group; `geometry` builds a mesh with
    sizes and ranks alone, for layout code that issues no collective (`zero3 estimate`).
    """

    shard_size: int
    shard_rank: int
    shard_group: dist.ProcessGroup | None = None
    replicate_size: int = 1
    replicate_rank: int = 0
    replicate_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        for what, size, rank in (("shard", self.shard_size, self.shard_rank),
                                 ("replicate", self.replicate_size, self.replicate_rank)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"ShardMesh: {what} rank {rank} outside a {what} group of size {size}")

    # ---- construction ----------------------------------------------------------
    @classmethod
    def of_group(cls, group: dist.ProcessGroup | None = None) -> ShardMesh:
        """Shard over every rank of `group` (default: the whole job), one replica: plain ZeRO-3."""
        return cls(shard_size=dist.get_world_size(group), shard_rank=dist.get_rank(group), shard_group=group)

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> ShardMesh:
        """A 1-D mesh shards over its one dimension; a 2-D mesh is (replicate, shard), as FSDP2's HSDP."""
        if device_mesh.ndim == 1:
            return cls(shard_size=device_mesh.size(), shard_rank=device_mesh.get_local_rank(),
                       shard_group=device_mesh.get_group())
        if device_mesh.ndim == 2:
            return cls(
                shard_size=device_mesh.size(1), shard_rank=device_mesh.get_local_rank(1),
                shard_group=device_mesh.get_group(1),
                replicate_size=device_mesh.size(0), replicate_rank=device_mesh.get_local_rank(0),
                replicate_group=device_mesh.get_group(0),
            )
        raise ValueError(f"ShardMesh: a device mesh of 1 (shard) or 2 (replicate, shard) dimensions, got {device_mesh.ndim}")

    @classmethod
    def geometry(cls, shard_size: int, shard_rank: int = 0) -> ShardMesh:
        """Sizes and ranks only: for code that lays shards out and never communicates."""
        return cls(shard_size=shard_size, shard_rank=shard_rank)

    # ---- facts -----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks the model's state is spread over: shard group times replicas."""
        return self.shard_size * self.replicate_size

    @property
    def sharded(self) -> bool:
        """Whether a parameter is split at all (a shard group of one holds it whole)."""
        return self.shard_size > 1

    def shard_numel(self, numel: int) -> int:
        """Elements of one rank's shard of a `numel`-element parameter (padded)."""
        return -(-numel // self.shard_size)

    def shard_range(self, numel: int) -> tuple[int, int]:
        """[start, end) of this rank's shard within the unpadded flattened parameter (may be empty)."""
        size = self.shard_numel(numel)
        start = min(self.shard_rank * size, numel)
        return start, min(start + size, numel)


REPLICATE, SHARD = "replicate", "shard"  # the mesh's dimension names, FSDP2's HSDP order
HPZ_OUTER, HPZ = "hpz_groups", "hpz"  # hpZ's secondary mesh: (groups, ranks in a group)
QGZ_ACROSS, QGZ_INSIDE = "qgz_across", "qgz_inside"  # qgZ's mesh over a shard group: (nodes, ranks of a node)


class TopologyError(ValueError):
    """The job's layout (its nodes, a group size from the config, a mesh) cannot be built."""


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
    """This rank's place in the job and the engine's process groups (see the Note)."""

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
    # qgZ's two groups over the shard group (see the Note); None when zero_quantized_gradients is off.
    grads_inside: ShardMesh | None = None
    grads_across: ShardMesh | None = None
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
              quantized_gradients: bool = False) -> Topology:
        """The topology of the whole job (collective: every rank calls it at the same point).

        `mesh`: the user's DeviceMesh: 1-D shards over its one dimension, 2-D is (replicate, shard).
        `mics_shard_size` (the config's): shard groups of that many consecutive ranks, replicas across
        them (-1: off). Without either, every rank shards (plain ZeRO-3), on groups made here.
        `hpz_partition_size` (the config's `zero_hpz_partition_size`): hpZ's secondary groups of that many
        consecutive ranks (1 or 0: off). `quantized_gradients` (`zero_quantized_gradients`): qgZ's groups."""
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if world_size == 1:
            _shape(mesh, mics_shard_size, world_size)  # a bad mesh or size is an error at any world size
            nodes = NodeLayout.agreed([NodeLayout.own_view(rank, world_size)], 0)
            hpz_group_size(hpz_partition_size, 1, 1)
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
        except BaseException:
            for group in made:
                dist.destroy_process_group(group)
            raise
        return cls(rank, world_size, nodes, device_mesh, shard, reduce_group, control, job, host_shard_group,
                   host_replicate_group, timeout, secondary, grads_inside, grads_across, made)

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


def mics_group_size(mics_shard_size: int, world_size: int) -> int:
    """The ranks each state is sharded over at `world_size` (`zero_optimization.mics_shard_size`, -1: every
    rank); a `TopologyError` naming both numbers where the size does not divide the world."""
    if mics_shard_size == -1:
        return world_size
    if mics_shard_size < 1 or world_size % mics_shard_size:
        raise TopologyError(
            f"zero_optimization.mics_shard_size={mics_shard_size} does not divide the world size {world_size}: "
            "expected a divisor of it (ranks per shard group), or -1"
        )
    return mics_shard_size


def hpz_group_size(hpz_partition_size: int, shard_size: int, ranks_per_node: int) -> int:
    """The ranks of an hpZ secondary group (`zero_optimization.zero_hpz_partition_size`; 1 or 0: off, as in
    DeepSpeed); a `TopologyError` naming the numbers where the size does not divide the shard group or
    the node (a secondary group must lie inside both: its gathers are to stay on the node)."""
    size = hpz_partition_size
    if size <= 1:
        return 1
    if shard_size % size:
        raise TopologyError(
            f"zero_optimization.zero_hpz_partition_size={size} does not divide the shard group's {shard_size} "
            "ranks (the world size, or mics_shard_size): expected a divisor of it, usually the ranks per node"
        )
    if ranks_per_node % size:
        raise TopologyError(
            f"zero_optimization.zero_hpz_partition_size={size} does not divide the {ranks_per_node} ranks per "
            "node (LOCAL_WORLD_SIZE): expected a divisor of it, so that each secondary group lies inside a node"
        )
    return size


def qgz_inside_size(shard_size: int, ranks_per_node: int) -> int:
    """The ranks of a shard group on one node, for qgZ's all-to-all inside the node: the node's ranks where
    shard groups span nodes, the shard group where it lies inside one; a `TopologyError` where neither
    size divides the other (the group's ranks on a node would differ from node to node)."""
    if shard_size % ranks_per_node == 0:
        return ranks_per_node
    if ranks_per_node % shard_size == 0:
        return shard_size
    raise TopologyError(
        f"zero_optimization.zero_quantized_gradients with shard groups of {shard_size} ranks on nodes of "
        f"{ranks_per_node}: expected one of the two sizes to divide the other, so that every node holds the "
        "same part of each shard group"
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
