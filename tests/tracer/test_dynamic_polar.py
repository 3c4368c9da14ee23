"""`torch.polar` with symbolic sizes (issue 16): PyTorch's meta kernel reads the strides as
ints, which specialised every length of a complex rotary embedding (HF Llama4 compiled once
per prompt length). The override describes eager's output: values, dtype and strides equal
eager's for every layout, and one symbolic compilation serves every length."""

import pytest
import torch

import fulmen


def _rotary(x, inv_freq):
    """HF Llama4's rotary embedding: positions times frequencies, as unit complex numbers."""
    angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.polar(torch.ones_like(angles), angles)


def _layouts(n: int, dtype):
    base = torch.randn(n, 6, dtype=dtype)
    return {
        "contiguous": (base, base.cos()),
        "transposed": (base.t(), base.t().cos()),
        "broadcast": (base[:, :1], base.sin()),
        "mixed": (base.t().contiguous().t(), base.cos()),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "broadcast", "mixed"])
def test_polar_equals_eager_with_symbolic_sizes(layout, dtype):
    jfn = fulmen.jit(torch.polar, dynamic=True)
    for n in (3, 5, 8):
        magnitude, angle = _layouts(n, dtype)[layout]
        want, got = torch.polar(magnitude, angle), jfn(magnitude, angle)
        assert got.dtype == want.dtype and got.stride() == want.stride(), layout
        torch.testing.assert_close(got, want)


def test_a_rotary_embedding_through_polar_compiles_twice_for_five_lengths():
    jfn = fulmen.jit(_rotary)
    inv_freq = torch.rand(4)
    for length in (5, 7, 9, 11, 13):
        x = torch.randn(2, length)
        torch.testing.assert_close(jfn(x, inv_freq), _rotary(x, inv_freq))
    stats = fulmen.compile_stats(jfn)
    assert stats.cache_misses == 2 and stats.eager_calls == 0, stats.recompile_reasons
