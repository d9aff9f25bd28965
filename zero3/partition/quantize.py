"""Block quantization for ZeRO++'s quantized collectives: what crosses the wire instead of 16-bit values.

[Note: block quantization]
A flat tensor is cut into blocks of `block` elements (the last one padded
with zeros), and each block is scaled by its own largest magnitude onto the
symmetric integer range (127 for int8, 7 for int4) and rounded to nearest,
as the ZeRO++ paper's block quantization does. Each block's fp32 scale
travels with its codes in one byte buffer, [codes | scales], so one
collective carries both. int4 codes are packed two to a byte. Every step
is a whole-tensor torch op on a [blocks, block] view: no Python loop runs
over blocks, so the same code is a few fused kernels on a GPU.

Only values on the wire are rounded: the shards, masters and optimizer
states they came from stay exact (zero3.partition.collectives'
`ParamGather.exact` for every path that keeps what it gathers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # one fp32 scale per block


@dataclass(frozen=True)
class BlockQuantizer:
    """Symmetric block quantization to `bits` (8 or 4) with one fp32 scale per `block` elements."""

    bits: int = 8
    block: int = 256

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"BlockQuantizer: bits={self.bits}, expected 8 or 4")
        if self.block < 8 or self.block % 8:
            # a multiple of 8 keeps the scales after the codes 4-byte aligned at either width
            raise ValueError(f"BlockQuantizer: block={self.block}, expected a multiple of 8 elements")

    @property
    def levels(self) -> int:
        """The largest code: 127 (int8) or 7 (int4)."""
        return 2 ** (self.bits - 1) - 1

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def code_bytes(self, numel: int) -> int:
        return self.blocks(numel) * self.block * self.bits // 8

    def encoded_bytes(self, numel: int) -> int:
        """Bytes of `numel` values on the wire: the codes, then one scale per block."""
        return self.code_bytes(numel) + SCALE_BYTES * self.blocks(numel)

    # ---- encode -------------------------------------------------------------------
    def quantize(self, values: torch.Tensor, out: torch.Tensor, rows: int = 1) -> None:
        """Encode `values` (any float dtype) into the uint8 `out`: `rows` rows of values.numel() / rows
        elements each, row r's encoding at out[r*e:(r+1)*e], e = encoded_bytes(row length)."""
        numel = values.numel() // rows
        blocks, code_bytes = self.blocks(numel), self.code_bytes(numel)
        padded = torch.zeros(rows, blocks * self.block, dtype=torch.float32, device=values.device)
        padded[:, :numel].copy_(values.reshape(rows, numel))
        cut = padded.view(rows * blocks, self.block)
        scales = cut.abs().amax(dim=1, keepdim=True) / self.levels
        # An all-zero block keeps scale 0 (it decodes to zeros); divide by 1 there instead of 0.
        codes = torch.round(cut / torch.where(scales > 0, scales, torch.ones_like(scales)))
        codes.clamp_(-self.levels, self.levels)
        table = out.view(rows, code_bytes + SCALE_BYTES * blocks)
        if self.bits == 8:
            table[:, :code_bytes].view(torch.int8).copy_(codes.view(rows, -1))
        else:  # two codes a byte: the even element in the low nibble, offset to 1..15
            nibbles = (codes + 8).to(torch.uint8).view(rows, -1, 2)
            table[:, :code_bytes].copy_(nibbles[..., 0] | (nibbles[..., 1] << 4))
        table[:, code_bytes:].view(torch.float32).copy_(scales.view(rows, blocks))

    def encode(self, values: torch.Tensor, rows: int = 1) -> torch.Tensor:
        out = torch.empty(rows * self.encoded_bytes(values.numel() // rows), dtype=torch.uint8, device=values.device)
        self.quantize(values, out, rows)
        return out

    # ---- decode -------------------------------------------------------------------
    def dequantize(self, encoded: torch.Tensor, numel: int, out: torch.Tensor) -> None:
        """Decode rows of encoded values: `encoded` is [rows * encoded_bytes(numel)] uint8, `out` is
        [rows * numel] of any float dtype (row r's values at out[r*numel:(r+1)*numel])."""
        per_row, blocks, code_bytes = self.encoded_bytes(numel), self.blocks(numel), self.code_bytes(numel)
        rows = encoded.numel() // per_row
        table = encoded.view(rows, per_row)
        if self.bits == 8:
            codes = table[:, :code_bytes].view(torch.int8).to(torch.float32)
        else:
            packed = table[:, :code_bytes]
            codes = torch.stack(((packed & 0x0F), (packed >> 4)), dim=-1).view(rows, -1).to(torch.float32) - 8
        scales = table[:, code_bytes:].contiguous().view(torch.float32).view(rows, blocks, 1)
        values = (codes.view(rows, blocks, self.block) * scales).view(rows, blocks * self.block)
        out.view(rows, numel).copy_(values[:, :numel])

    def decode(self, encoded: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows = encoded.numel() // self.encoded_bytes(numel)
        out = torch.empty(rows * numel, dtype=dtype, device=encoded.device)
        self.dequantize(encoded, numel, out)
        return out


class QuantizedShards:
    """qwZ's codec for a parameter all-gather (zero3.partition.collectives' `ShardCodec`): each rank's
    16-bit shard travels as int8 blocks with their scales, and arrives in the parameters' dtype."""

    def __init__(self, quantizer: BlockQuantizer | None = None) -> None:
        self.quantizer = quantizer or BlockQuantizer(bits=8)

    def encoded_numel(self, shard_numel: int) -> int:
        return self.quantizer.encoded_bytes(shard_numel)

    def encoded_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def encode(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        self.quantizer.quantize(shard, out)

    def decode(self, gathered: torch.Tensor, out: torch.Tensor, ranks: int) -> None:
        self.quantizer.dequantize(gathered, out.numel() // ranks, out)
