"""`resize_token_embeddings` on a partitioned Hugging Face model (built under zero3.Init or by
zero3's `from_pretrained`), before it goes to an engine.

Transformers' own method reads the embedding's shape and rows, which a partitioned parameter does not
hold (a zero-element placeholder between gathers); under DeepSpeed it gathers them through DeepSpeed's
names. Here the input embedding and the output head are made whole for the call (their fp32 values: the
master seeds, exact), transformers' own method resizes them by its rules (padding to a multiple, mean
resizing, tying, the config's vocabulary size), and the resized modules are partitioned again with rank
0's values on every rank (new rows drawn at random agree). Only these two matrices are ever whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import zero3
from zero3.partition.collectives import gather_full_fp32
from zero3.partition.sharded_param import ShardedParam, sharded
from zero3.partition.unit import unit_of


def _embedding_params(model: Any) -> list[nn.Parameter]:
    """The parameters of the input embedding and the output head, each once (a tied weight is one)."""
    found: dict[int, nn.Parameter] = {}
    heads = [model.get_input_embeddings()]
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None:
        heads.append(output)
    for head in heads:
        for param in head.parameters(recurse=False):
            found.setdefault(id(param), param)
    return list(found.values())


def _full_fp32(sp: ShardedParam) -> torch.Tensor:
    """The whole fp32 value of a partitioned parameter (collective), through the unit that gathers it: the
    rows kept are exactly the ones the engine would start from."""
    unit = unit_of(sp)
    if unit is None or (sp.lp_slot is None and sp.lean_master is None):
        raise RuntimeError(f"resize_token_embeddings: {sp.name} has no shards to read (its engine was destroyed)")
    return gather_full_fp32(sp, unit.gather, sp.placeholder.device)


def _replace_everywhere(model: nn.Module, replacement: dict[int, nn.Parameter]) -> None:
    """Every module slot holding one of the keyed parameters holds its replacement instead (tied weights
    stay tied: each slot of one parameter gets the same replacement)."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in replacement:
                dict.__setitem__(module._parameters, name, replacement[id(param)])


def resize_token_embeddings(
    model: Any, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
    mean_resizing: bool = True,
) -> nn.Embedding:
    """Transformers' `model.resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)`
    for a model whose parameters zero3 partitioned (a plain model gets transformers' method as is). Call it
    on every rank (it is collective), before `zero3.initialize` or the `Zero3Trainer`. Returns the input
    embedding module, as transformers does."""
    if not hasattr(model, "get_input_embeddings") or not hasattr(type(model), "resize_token_embeddings"):
        raise TypeError(f"resize_token_embeddings: expected a transformers PreTrainedModel, got {type(model).__name__}")
    params = _embedding_params(model)
    partitioned = [(param, sp) for param in params if (sp := sharded(param)) is not None]
    if not partitioned:
        return type(model).resize_token_embeddings(model, new_num_tokens, pad_to_multiple_of, mean_resizing)
    if len(partitioned) != len(params):
        raise ValueError("resize_token_embeddings: the embedding and the output head are partly partitioned; "
                         "expected all of their parameters built under zero3.Init or none")
    in_engine = [sp.name for _, sp in partitioned if sp.on_access is not None]
    if in_engine:
        raise RuntimeError(f"resize_token_embeddings: {', '.join(in_engine)} already belong to a zero3 engine "
                           "(its optimizer holds their shards); resize before zero3.initialize / Zero3Trainer")
    dtype = partitioned[0][1].dtype
    device = partitioned[0][1].placeholder.device
    whole = {id(param): nn.Parameter(_full_fp32(sp), requires_grad=param.requires_grad) for param, sp in partitioned}
    _replace_everywhere(model, whole)
    try:
        embeddings = type(model).resize_token_embeddings(model, new_num_tokens, pad_to_multiple_of, mean_resizing)
    except BaseException:
        _replace_everywhere(model, {id(whole[id(old)]): old for old, _ in partitioned})  # as it was
        raise
    # The resized modules are partitioned again (the ones left whole by an unchanged size too): the input
    # embedding first, so a tied head finds its weight partitioned already.
    heads = [model.get_input_embeddings(), model.get_output_embeddings()]
    for head in heads:
        if head is not None:
            zero3.Init(module=head, dtype=dtype, device=device)
    return embeddings
