"""Muon's part of the optimizer step (zero3.optim.muon's Note): each stepped matrix's direction, made from
this rank's shards, then orthogonalized across the shard group before the elementwise walk applies it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zero3.comm import Communicator
from zero3.offload.optimizer_tier import OptimizerStates
from zero3.optim.muon import Matrix, MatrixExchange, MuonAdamW, direction
from zero3.config import MuonParams
from zero3.partition.sharded_param import ShardedParam
from zero3.step.layout import SubGroup


class MuonDirections:
    """The matrices' directions buffer (what MuonAdamW reads per piece) and their exchange."""

    def __init__(
        self, optimizer: MuonAdamW, groups: list[tuple[list[ShardedParam], dict[str, Any]]], sub_groups: list[SubGroup],
        order_offsets: dict[ShardedParam, int], settings: MuonParams, step_device: torch.device,
        comm: Communicator, bucket_numel: int,
    ) -> None:
        self.optimizer = optimizer
        self.sub_groups = sub_groups
        matrices = [sp for sps, options in groups if options.get("use_muon") for sp in sps]
        # split_groups puts the Muon groups first, so their masters are [0, total) of the flat buffers.
        total = sum(sp.shard_numel for sp in matrices)
        assert all(order_offsets[sp] < total for sp in matrices)
        self.directions = torch.zeros(total, dtype=torch.float32, device=step_device)
        for sub in sub_groups:
            if sub.muon:
                for piece, master in zip(sub.pieces, sub.masters):
                    start = order_offsets[piece.sp] + piece.start
                    optimizer.updates[master] = self.directions[start : start + piece.numel]
                    optimizer.shapes[master] = piece.sp.shape
        self.exchange: MatrixExchange | None = None
        if not matrices:
            return
        mesh = matrices[0].mesh
        group = mesh.shard_group
        if step_device.type == "cpu" and dist.get_backend(group) != "gloo" and comm.topology is not None:
            group = comm.topology.host_shard_group  # host tensors (ZeRO-Offload beside a GPU) travel on gloo
        self.exchange = MatrixExchange(
            [Matrix(sp, sp.shape, sp.numel, sp.shard_numel, order_offsets[sp]) for sp in matrices],
            mesh.shard_rank, mesh.shard_size, group, bucket_numel, settings,
        )

    def orthogonalize(
        self, states: OptimizerStates, arrived: dict[ShardedParam, bool], fresh: set[torch.nn.Parameter],
        fill_grad: Callable[[SubGroup, torch.Tensor], None], coefficient: torch.Tensor | None, idle: set[int],
        work: torch.Tensor,
    ) -> None:
        """Phases 1 and 2 of zero3.optim.muon's Note: this rank's shards of every stepped matrix's
        direction (the state only read), then the exchange that orthogonalizes them. A failure in the
        first phase still joins the exchange (its collectives pair with the other ranks'), then raises."""
        assert self.exchange is not None
        skip = {index for index, sub in enumerate(self.sub_groups) if not sub.muon} | idle

        def visit(index: int, window: dict[str, torch.Tensor]) -> None:
            sub = self.sub_groups[index]
            group = self.optimizer.param_groups[sub.group_index]
            grad = work[: sub.numel]
            fill_grad(sub, grad)
            if coefficient is not None:
                grad.mul_(coefficient)
            cursor = 0
            for piece, master in zip(sub.pieces, sub.masters):
                if arrived[piece.sp]:
                    piece_grad = grad[cursor : cursor + piece.numel]
                    # A piece torch has not stepped yet starts from a zero buffer (whatever the flat buffer holds).
                    buffer = (torch.zeros_like(piece_grad) if master in fresh
                              else window["exp_avg"][cursor : cursor + piece.numel])
                    self.directions[sub.offset + cursor : sub.offset + cursor + piece.numel].copy_(
                        direction(piece_grad, buffer, group["momentum"], group["nesterov"]))
                cursor += piece.numel

        failure: Exception | None = None
        try:
            states.walk([(sub.offset, sub.numel) for sub in self.sub_groups], visit, skip, readonly=True)
        except Exception as error:  # noqa: BLE001 - raised below, once the exchange is done
            failure = error
        self.exchange.orthogonalize(self.directions, {m.key for m in self.exchange.matrices if arrived[m.key]})
        if failure is not None:
            raise failure
