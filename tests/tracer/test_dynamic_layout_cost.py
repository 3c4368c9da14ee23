"""Elementwise layouts of symbolic compilations described by rules instead of PyTorch's meta kernels on fake
tensors (a fake tensor with symbolic sizes costs milliseconds to make and each of its kernels
more). Each test counts the fake-tensor work that is absent, never how long anything takes, and
checks the layouts against eager's at several sizes."""

import sys

import pytest
import torch

import fulmen
from fulmen.ops import elementwise_layout


@pytest.fixture
def fake_modes(monkeypatch):
    """The values `fulmen.ops.elementwise_layout._fake_mode` was asked about by the elementwise layout query:
    one per elementwise op whose layout PyTorch's kernels computed on fake tensors (other ops,
    `expand`, have meta kernels of their own)."""
    asked = []
    original = elementwise_layout._fake_mode

    def counting(value):
        if sys._getframe(1).f_code.co_name == "_elementwise_strides":
            asked.append(value)
        return original(value)

    monkeypatch.setattr(elementwise_layout, "_fake_mode", counting)
    return asked


def _last_half(x):
    return torch.neg(x[..., : x.shape[-1] // 2])  # rotate_half's slice, a view with gaps


def _strided(x):
    return torch.exp(x[:, ::2].transpose(0, 1))


def _overlapping(x):
    return torch.sin(x[:, :1].expand(x.shape[0], 3, x.shape[2]))


def _permuted_slice(x):
    return torch.abs(x.permute(2, 0, 1)[1:])


@pytest.mark.parametrize("fn", [_last_half, _strided, _overlapping, _permuted_slice])
def test_a_unary_op_on_a_view_that_is_not_dense_is_laid_out_by_rule(fn, fake_modes):
    """One operand with gaps or overlaps: PyTorch's rule is `empty_like` of it (the operand's
    stride order, laid out densely); the symbolic compile answers it without fake tensors and
    the outputs have eager's strides at every size. (On the torch executor: what the codegen
    executor returns is the next test's.)"""
    jfn = fulmen.jit(fn, dynamic=True, executors=["torch"])
    for shape in ((4, 6, 8), (3, 10, 8), (5, 4, 6)):
        x = torch.randn(shape)
        out, expected = jfn(x), fn(x)
        torch.testing.assert_close(out, expected)
        assert out.stride() == expected.stride(), (shape, out.stride(), expected.stride())
    assert fulmen.cache_misses(jfn) == 1
    assert not fake_modes


def _permuted_add(x, y):
    return torch.sigmoid(x.permute(2, 0, 1) + y.permute(2, 0, 1))


def _channels_last_scale(x, w):
    return torch.relu(x * w[None, :, None, None] + 1)


def _broadcast_mix(x, b):
    return torch.tanh(x) * b  # a permuted operand against a broadcast row-major one


def _inputs(fn, n):
    """Inputs of `fn` for the n-th size of a sweep (other sizes each time)."""
    a, b, c = (3 + n, 5 + 2 * n, 4 + n)
    if fn is _strided:
        return (torch.randn(a, b, c),)
    if fn is _permuted_add:
        return torch.randn(a, b, c), torch.randn(a, b, c)
    if fn is _channels_last_scale:
        x = torch.randn(2, c, a, b).to(memory_format=torch.channels_last)
        return x, torch.randn(c)
    return torch.randn(a, b, c).permute(1, 0, 2), torch.randn(c)


@pytest.mark.parametrize("fn", [_strided, _permuted_add, _channels_last_scale, _broadcast_mix])
def test_a_fused_region_with_symbolic_sizes_returns_eagers_strides(fn, codegen_eager):
    """The codegen executor writes a region's outputs row-major (`runtime.py`, `empty`); the
    claim pass relays a returned output whose eager layout is permuted (NOTE [output layout]),
    and with symbolic sizes its strides are expressions of the sizes, evaluated at each call:
    an elementwise op on `x[:, ::2].transpose(0, 1)` returns eager's (8, 24, 1), not (32, 8, 1),
    and channels_last inputs give channels_last outputs, at every size of one compilation."""
    jfn = fulmen.jit(fn, dynamic=True)
    for n in range(3):
        args = _inputs(fn, n)
        out, expected = jfn(*args), fn(*args)
        torch.testing.assert_close(out, expected)
        assert out.stride() == expected.stride(), (n, out.stride(), expected.stride())
    assert fulmen.cache_misses(jfn) == 1
    assert any(name.startswith("fusion") for name in fulmen.last_kernels(jfn))


def _heads_merged(x):
    # attention's output: heads transposed back, then merged (a reshape that copies)
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1) * 2


def test_meta_kernels_on_fake_tensors_skip_pytorchs_dispatch_cache(monkeypatch):
    """Layouts no rule gives come from PyTorch's meta kernels on fake tensors; their fake mode
    makes no dispatch-cache entries (each costs a walk over the output's symbols, and fulmen
    keeps its answers itself). The results keep eager's values and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    entries = []
    original = FakeTensorMode._make_cache_entry

    def counting(self, *args, **kwargs):
        entries.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FakeTensorMode, "_make_cache_entry", counting)
    jfn = fulmen.jit(_heads_merged, dynamic=True)
    for shape in ((2, 4, 5, 8), (3, 4, 7, 8)):
        x = torch.randn(shape)
        out, expected = jfn(x), _heads_merged(x)
        torch.testing.assert_close(out, expected)
        assert out.stride() == expected.stride()
    assert fulmen.cache_misses(jfn) == 1
    assert not entries


def _scaled(x, w, cos):
    return (x * w) * cos + x  # a weight and a rotary table broadcast beside the activation


def test_broadcast_operands_beside_a_row_major_one_skip_the_permutation_rule(monkeypatch):
    """Operands that are row-major where they are not broadcast (stride 0) give a row-major
    output (TensorIterator keeps every dim in place): decided from the strides as expressions,
    without PyTorch's permutation rule on SymInts (a sympy comparison per pair of dims). The
    outputs have eager's strides at every size."""
    import torch._prims_common as prims_common

    asked = []
    original = prims_common.compute_elementwise_output_logical_to_physical_perm

    def counting(*args, **kwargs):
        asked.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(prims_common, "compute_elementwise_output_logical_to_physical_perm",
                        counting)
    jfn = fulmen.jit(_scaled, dynamic=True, executors=["torch"])
    for batch, length in ((2, 5), (3, 9), (4, 6)):
        x, w, cos = torch.randn(batch, length, 8), torch.randn(8), torch.randn(1, length, 8)
        out, expected = jfn(x, w, cos), _scaled(x, w, cos)
        torch.testing.assert_close(out, expected)
        assert out.stride() == expected.stride()
    assert fulmen.cache_misses(jfn) == 1
    assert not asked


def test_a_size_one_dim_broadcast_takes_no_part_in_the_layout():
    """`x (n, 1) + y (n, m)` with symbolic sizes: x's size-1 dim is broadcast (stride 0), so
    it takes no part in the stride order and y's row-major layout decides, as in eager; had x's
    own stride on it (1, equal to its dim-0 stride) counted, the tie would be broken by the
    sizes (m > n: swap) and the sum described column-major, which `view(-1)` refuses."""
    def fn(x, y):
        z = x + y
        return z.view(-1) * 2, z.is_contiguous()

    jfn = fulmen.jit(fn, dynamic=True, executors=["torch"])
    for n, m in ((3, 5), (4, 7), (2, 9)):
        x, y = torch.randn(n, 1), torch.randn(n, m)
        (out, contiguous), (expected, eager_contiguous) = jfn(x, y), fn(x, y)
        assert torch.equal(out, expected) and contiguous == eager_contiguous
    assert fulmen.cache_misses(jfn) == 1
