"""zero3.partition.quantize: block quantization (ZeRO++'s wire format), against plain per-block arithmetic."""

from __future__ import annotations

import pytest
import torch

from zero3.partition.quantize import SCALE_BYTES, BlockQuantizer, QuantizedShards


def reference(values: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """What block quantization means, one block at a time (the slow way the engine must not take)."""
    levels = 2 ** (bits - 1) - 1
    out = torch.empty(values.numel(), dtype=torch.float32)
    flat = values.float().reshape(-1)
    for start in range(0, flat.numel(), block):
        chunk = flat[start : start + block]
        scale = chunk.abs().max() / levels
        out[start : start + block] = 0 if scale == 0 else torch.round(chunk / scale).clamp(-levels, levels) * scale
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_round_trip_is_the_per_block_rounding(bits: int, numel: int, dtype: torch.dtype) -> None:
    quantizer = BlockQuantizer(bits=bits, block=256)
    values = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    encoded = quantizer.encode(values)
    assert encoded.dtype is torch.uint8 and encoded.numel() == quantizer.encoded_bytes(numel)
    blocks = -(-numel // 256)
    assert encoded.numel() == blocks * 256 * bits // 8 + SCALE_BYTES * blocks
    decoded = quantizer.decode(encoded, numel)
    torch.testing.assert_close(decoded, reference(values, bits, 256), rtol=1e-6, atol=1e-6)
    # the error stays within half a step of each block's scale
    step = values.float().abs().max() / quantizer.levels
    assert (decoded - values.float()).abs().max() <= step / 2 + 1e-6


def test_rows_decode_each_with_their_own_scales_and_zero_blocks_stay_zero() -> None:
    quantizer = BlockQuantizer(bits=8, block=8)
    rows = [torch.zeros(12), torch.linspace(-1, 1, 12) * 1000, torch.full((12,), 1e-3)]
    wire = torch.cat([quantizer.encode(row) for row in rows])
    out = torch.empty(3 * 12, dtype=torch.bfloat16)
    quantizer.dequantize(wire, 12, out)
    assert torch.equal(out[:12], torch.zeros(12, dtype=torch.bfloat16))
    for r, row in enumerate(rows[1:], start=1):
        torch.testing.assert_close(out[r * 12 : (r + 1) * 12].float(), reference(row, 8, 8), rtol=1e-2, atol=0)


def test_the_gather_codec_reads_its_rows_from_the_rank_count() -> None:
    codec = QuantizedShards()
    shards = [torch.randn(300, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16) for r in range(4)]
    wire = torch.empty(4 * codec.encoded_numel(300), dtype=codec.encoded_dtype(torch.bfloat16))
    for r, shard in enumerate(shards):
        codec.encode(shard, wire.narrow(0, r * codec.encoded_numel(300), codec.encoded_numel(300)))
    out = torch.empty(4 * 300, dtype=torch.bfloat16)
    codec.decode(wire, out, 4)
    for r, shard in enumerate(shards):
        expected = reference(shard, 8, 256).to(torch.bfloat16)
        assert torch.equal(out[r * 300 : (r + 1) * 300], expected)


def test_bad_widths_and_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="bits=2, expected 8 or 4"):
        BlockQuantizer(bits=2)
    with pytest.raises(ValueError, match="block=12, expected a multiple of 8"):
        BlockQuantizer(block=12)


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_encode_apart_as_if_each_were_encoded_alone(bits: int) -> None:
    """qgZ's all-to-all sends each destination its own row: a row's blocks never reach into the next."""
    quantizer = BlockQuantizer(bits=bits, block=64)
    table = torch.randn(3, 100, generator=torch.Generator().manual_seed(3))
    table[1] *= 1000  # a large row must not widen its neighbours' scales
    together = quantizer.encode(table, rows=3)
    assert torch.equal(together, torch.cat([quantizer.encode(row) for row in table]))
    decoded = quantizer.decode(together, 100).view(3, 100)
    for row, values in zip(decoded, table):
        torch.testing.assert_close(row, reference(values, bits, 64), rtol=1e-6, atol=1e-6)
