"""Small models that exercise the engine's hard cases, and a plain-torch reference trainer."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 64, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return F.mse_loss(self.fc3(h).float(), y.float())


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        # No qkv bias: the key bias has an exactly-zero true gradient, which Adam
        # turns into rounding-noise-sized updates that no two summation orders share.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TiedTransformer(nn.Module):
    """Token embedding tied to the output head (the same Parameter in two modules)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 2, layers: int = 2, block: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(block, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class CheckpointedTransformer(TiedTransformer):
    """Blocks under non-reentrant activation checkpointing: their forward reruns inside backward."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class GradientPenalty(nn.Module):
    """A forward that runs a backward: an input-gradient penalty (`torch.autograd.grad`, create_graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        out = self.body(x)
        (dx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return F.mse_loss(out, y) + 0.1 * dx.pow(2).mean()


class FrozenFirstLayer(nn.Module):
    """A frozen layer (requires_grad=False) in front of trained ones."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 32)
        self.frozen.requires_grad_(False)
        self.mlp = MLP(32, 32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.tanh(self.frozen(x)), y)


class Branchy(nn.Module):
    """Data-dependent control flow: which modules run, and in what order, changes per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.left = nn.Linear(32, 32)
        self.right = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        # The same on every rank (the batch's first feature is shared), different across steps.
        route = int(x[0, 0].item() * 1000) % 3
        if route == 0:
            h = self.left(h)
        elif route == 1:
            h = self.right(h)
        else:
            h = self.left(self.right(h)) + self.left(h)  # both, and `left` twice
        return F.mse_loss(self.head(h).float(), y.float())


# Per-rank routes of `Routed`: which experts run, in which order (some twice, one never).
ROUTES = ((0,), (1, 2), (2, 0, 2), (), (1,), (2, 1), (0, 1, 2))


class Routed(nn.Module):
    """Each rank routes its own batch: experts chosen (and ordered, and repeated) by its data,
    and `extra` skipped on some ranks. `experts[3]` is never used by anyone."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.extra = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    @staticmethod
    def code(x: torch.Tensor) -> int:
        return int(abs(x[0, 1].item()) * 1000) % len(ROUTES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        code = self.code(x)
        h = torch.relu(self.stem(x))
        for index in ROUTES[code]:
            h = h + torch.tanh(self.experts[index](h))
        if code % 2:
            h = self.extra(h)
        return F.mse_loss(self.head(h).float(), y.float())


class RoutedSync(Routed):
    """`Routed` whose forward runs its own collective after the routed experts, on every rank (as DDP and
    FSDP require): an all-reduce, on the default group, of a statistic of each rank's hidden state."""

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        code = self.code(x)
        h = torch.relu(self.stem(x))
        for index in ROUTES[code]:
            h = h + torch.tanh(self.experts[index](h))
        return self.extra(h) if code % 2 else h

    def head_loss(self, h: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(h / (1 + scale)).float(), y.float())

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        h = self.hidden(x)
        scale = h.detach().abs().mean().reshape(1).clone()
        dist.all_reduce(scale)  # the sum over ranks
        return self.head_loss(h, y, scale)


class AttributeTiedLM(nn.Module):
    """The head reads the embedding's weight by attribute (not registered in the head)."""

    def __init__(self, vocab: int = 48, dim: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.embed(idx)))
        logits = F.linear(h, self.embed.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class BiasReturningLinear(nn.Module):
    """Returns its output without the bias, and the bias itself (Megatron's skip_bias_add)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.bias = nn.Parameter(torch.randn(d_out) * 0.1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, nn.Parameter]:
        return F.linear(x, self.weight), self.bias


class DanglingBias(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inner = BiasReturningLinear(d, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, bias = self.inner(x)
        h = torch.relu(h + bias) * bias  # the bias is used twice, once saved for backward
        return F.mse_loss(self.out(h).float(), y.float())


class DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        return {"loss": self.mlp(x, y), "aux": None, "note": "dict outputs pass through"}


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    hidden: torch.Tensor


class Recorder(nn.Module):
    """A module with parameters whose forward returns None (it leaves its result on itself)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.last: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> None:
        self.last = h * self.scale
        return None


class NoneOutput(nn.Module):
    """Returns None from forward; the loss is left on the module (and a child returns None too)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.rec = Recorder(8)
        self.loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.rec(self.fc(x))
        self.loss = F.mse_loss(self.rec.last.float(), y.float())
        return None


class DataclassOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Output:
        h = self.fc(x)
        return Output(loss=F.mse_loss(h.float(), y.float()), hidden=h)


def loss_of(output: object, model: nn.Module) -> torch.Tensor:
    """The loss, whatever shape the forward returned it in."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output["loss"]
    if isinstance(output, Output):
        return output.loss
    if output is None:
        return model.loss  # type: ignore[return-value]
    raise TypeError(type(output))


def batches(kind: str, steps: int, global_batch: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if kind == "tokens":
            idx = torch.randint(0, 48, (global_batch, 16), generator=g)
            out.append((idx, torch.roll(idx, -1, dims=1)))
        else:
            x = torch.randn(global_batch, 16, generator=g)
            if kind == "branch":
                x[:, 0] = x[0, 0]  # one route per step, shared by every row (so by every rank)
            out.append((x, torch.randn(global_batch, 4 if kind == "x4" else 8, generator=g)))
    return out


def reference_losses(
    model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], lr: float, weight_decay: float, clip: float,
    gas: int = 1, groups: list | None = None,
) -> tuple[list[float], nn.Module]:
    """Plain single-process torch: AdamW on the whole global batch, clip by global norm."""
    opt = torch.optim.AdamW(groups if groups is not None else model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for x, y in data:
        total = 0.0
        for xs, ys in zip(x.chunk(gas), y.chunk(gas)):
            loss = loss_of(model(xs, ys), model) / gas
            loss.backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model


def train_steps(engine, rank: int, world: int, batches: list) -> list[float]:
    """One optimizer step per global batch, each rank on its rows; returns this rank's losses."""
    losses = []
    for x, y in batches:
        x, y = x.chunk(world)[rank].to(engine.device), y.chunk(world)[rank].to(engine.device)
        loss = loss_of(engine(x, y), engine.module)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def mean_losses(engine, rank: int, world: int, batches: list) -> list[float]:
    """`train_steps`, each step's loss averaged over the ranks (the loss of the whole global batch)."""
    import torch.distributed as dist

    losses = []
    for local in train_steps(engine, rank, world, batches):
        total = torch.tensor([local], dtype=torch.float64, device=engine.device)  # nccl reduces device tensors
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def full_value(param: torch.Tensor) -> torch.Tensor:
    """A partitioned parameter's whole value in fp32 on the host (collective): its master, or for a frozen
    parameter (no master: DeepSpeed's safe_get_full_fp32_param answers None) its gathered 16-bit value.
    On the host so that it compares with the CPU reference whatever device the engine is on."""
    import zero3

    full = zero3.safe_get_full_fp32_param(param)
    if full is not None:
        return full.cpu()
    with zero3.GatheredParameters([param]):
        return param.detach().float().cpu().clone()


@contextlib.contextmanager
def flat_gradients(flat: bool = True) -> Iterator[None]:
    """Engines built inside keep the default layout's gradient shards in one flat buffer, even at several CPU
    ranks (where the engine makes them on demand); lean mode's stay on demand."""
    from zero3.engine import build as engine_build

    chosen = engine_build.made_on_demand
    if flat:
        engine_build.made_on_demand = lambda lean, *_, **__: lean  # type: ignore[assignment]
    try:
        yield
    finally:
        engine_build.made_on_demand = chosen
