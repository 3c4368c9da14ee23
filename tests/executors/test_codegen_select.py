"""`pad` and `cat` in codegen's pointwise kernels (NOTE [pad and cat in pointwise kernels] in
`fulmen/executors/codegen/lower.py`): each output point reads one operand at a shifted point
(masked loads: nothing is read outside an operand) or pad's constant. Checked against eager for
strided, broadcast and computed operands, every dtype kernels handle, crops, empty operands,
symbolic sizes, and the rotary embedding of HF Llama forward and backward (where `cat((-x2,
x1))` and its backward's pads fuse with the multiplies around them).
"""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.executors.codegen import CUDA, kernel_sources
from fulmen.executors.codegen.lower import fits_pointwise, lower
from fulmen.executors.codegen.ops import fusible
from tests.transforms.test_fusion import assert_pointwise_check_agrees_with_lowering

pytestmark = pytest.mark.usefixtures("codegen_eager")

EXECUTORS = ["codegen", "torch"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool]


def _fused_ops(jfn) -> str:
    """The prims inside the codegen fusions of the last execution trace (as printed)."""
    trace = str(fulmen.last_traces(jfn)[-1])
    return "\n".join(line for line in trace.splitlines() if line.strip().startswith("# t"))


def _check(fn, *args, fused=("cat",), **tol):
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    actual, expected = jfn(*args), fn(*args)
    tol = {"rtol": 0, "atol": 0, **tol}
    torch.testing.assert_close(actual, expected, equal_nan=True, **tol)
    for name in fused:
        assert f"prims.{name}(" in _fused_ops(jfn), fulmen.last_traces(jfn)[-1]
    return jfn


def _sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def _rotate(x, y):
    half = x.shape[-1] // 2
    return torch.cat((y[..., half:] == y[..., half:], x[..., :half]), -1) if x.dtype == torch.bool \
        else torch.cat((x[..., half:] + y[..., half:], x[..., :half]), dim=-1) * y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cat_of_computed_and_sliced_operands_every_dtype(dtype):
    x, y = _sample((3, 5, 8), dtype), _sample((3, 5, 8), dtype, seed=1)
    if dtype == torch.bool:
        _check(lambda a, b: torch.cat((a & b, a[:, :2]), dim=1) | b[:, :1], x, y)
    else:
        _check(_rotate, x, y)


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_cat_of_strided_and_broadcast_inputs_along_each_dim(dim):
    """Operands read transposed, with a step, broadcast (stride 0), and computed: every
    operand is read through its own strides at its offset along `dim`."""
    a = torch.randn(6, 4, 10).transpose(0, 2)  # (10, 4, 6), not contiguous
    b = torch.randn(10, 8, 12)[:, ::2, ::2]  # (10, 4, 6) with steps
    c = torch.randn(1, 4, 1).expand(10, 4, 6)  # broadcast
    sizes = {0: (10, 4, 6), 1: (10, 4, 6), 2: (10, 4, 6), -1: (10, 4, 6)}
    assert all(t.shape == sizes[dim] for t in (a, b, c))

    def fn(a, b, c):
        return torch.cat((a * 2, b, c.exp(), a - b), dim=dim).sin()

    _check(fn, a, b, c, rtol=1e-6, atol=1e-6)


def test_cat_of_operands_of_different_sizes_and_an_empty_one():
    a, b, c = torch.randn(4, 3), torch.randn(4, 0), torch.randn(4, 7)
    _check(lambda a, b, c: torch.cat((a.neg(), b, c, a), dim=1) + 1, a, b, c)


@pytest.mark.parametrize("pad", [(2, 3), (0, 1, 2, 0), (-1, 2), (-2, -1, 1, 1), (3, -3)])
@pytest.mark.parametrize("value", [0.0, -1.5, float("nan"), float("-inf")])
def test_pad_with_positive_and_negative_widths(pad, value):
    x = torch.randn(5, 6)[:, ::1].t()  # (6, 5), transposed

    def fn(x):
        return F.pad(x * 3, pad, value=value) - 1

    _check(fn, x, fused=("pad",))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pad_every_dtype(dtype):
    x = _sample((4, 5), dtype)
    value = True if dtype == torch.bool else 7 if not dtype.is_floating_point else 2.5

    def fn(x):
        y = x if dtype == torch.bool else x + x
        return F.pad(y, (1, 2, 2, 0), value=value)

    _check(fn, x, fused=("pad",) if dtype != torch.bool else ())


def test_pad_of_a_3d_tensor_on_an_outer_dim():
    """A padded outer dim: whole rows are masked out (their shifted pointers lie outside)."""
    x = torch.randn(3, 4, 5)
    _check(lambda x: F.pad(x.exp(), (0, 0, 0, 0, 2, 1)) + 1, x, fused=("pad",),
           rtol=1e-6, atol=1e-6)


def test_nested_cat_and_views_of_cat_results_are_right():
    """A cat inside another's operand, and a view of a cat's result, are not lowered (each
    region takes what it can); the results stay eager's."""
    x = torch.randn(4, 6)

    def fn(x):
        inner = torch.cat((x.neg(), x), dim=1)
        outer = torch.cat((inner.exp(), inner), dim=0)
        return outer.t() * 2, inner[:, 1:7].sin()

    jfn = fulmen.jit(fn, executors=EXECUTORS)
    for actual, expected in zip(jfn(x), fn(x), strict=True):
        torch.testing.assert_close(actual, expected)


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_embedding_forward_and_backward_fuse_and_match_eager(dtype):
    """HF Llama's apply_rotary_pos_emb on (batch, heads, seq, head_dim) views of projections:
    the forward's cat and the backward's pads are inside codegen fusions."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 4, 16, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 6, 2, 16, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    angles = torch.randn(2, 6, 8, generator=g).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    jfn = fulmen.jit(_rotary, executors=EXECUTORS)
    out = jfn(q, k, cos, sin)
    ref_q, ref_k = (t.detach().clone().requires_grad_() for t in (q, k))
    expected = _rotary(ref_q, ref_k, cos, sin)
    for a, e in zip(out, expected, strict=True):
        torch.testing.assert_close(a, e)
    grads = [torch.randn_like(e) for e in expected]
    torch.autograd.backward(out, grads)
    torch.autograd.backward(expected, grads)
    torch.testing.assert_close(q.grad, ref_q.grad)
    torch.testing.assert_close(k.grad, ref_k.grad)
    forward, backward = fulmen.last_traces(jfn)[-1], fulmen.last_backward_traces(jfn)[-1]
    assert "prims.cat(" in str(forward) and "torch.cat" not in str(forward)
    assert "prims.pad(" in str(backward) and "torchex.pad" not in str(backward)
    sources = "\n".join(kernel_sources(forward, backward).values())
    assert " ? " in sources  # masked loads


def _litgpt_rope(q, cos, sin):
    roped = q[..., :16] * cos + _rotate_half(q[..., :16]) * sin
    return torch.cat((roped, q[..., 16:]), dim=-1)  # nothing past 16: the head size is 16


def test_cat_with_an_empty_piece_fuses_as_a_copy_of_the_other_forward_and_backward():
    """litgpt's `cat((q_roped, q[..., rope_n_elem:]))` with rope_n_elem == head size: a cat of
    one piece with elements is a copy of it, which fuses into the rotary kernel (torch ran it
    as a separate copy, ~30 us each on tiny litgpt Llama's training step); the empty piece
    stays its operand, so what it is computed from still gets eager's (empty) gradient
    (`test_an_input_reached_through_an_empty_tensor_gets_zeros_as_in_eager`)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 4, 16, generator=g).transpose(1, 2).requires_grad_()
    angles = torch.randn(6, 8, generator=g).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    jfn = fulmen.jit(_litgpt_rope, executors=EXECUTORS)
    out = jfn(q, cos, sin)
    ref_q = q.detach().clone().requires_grad_()
    expected = _litgpt_rope(ref_q, cos, sin)
    torch.testing.assert_close(out, expected)
    assert out.data_ptr() != q.data_ptr() and out.shape == expected.shape
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(q.grad, ref_q.grad)
    forward = str(fulmen.last_traces(jfn)[-1])
    assert "torch.cat" not in forward and "codegen.fusion" in forward, forward
    # a cat of one piece is a fresh tensor, as eager's: writing to it leaves q alone
    out = jfn(q, cos, sin)
    before = q.detach().clone()
    out.detach().zero_()
    assert torch.equal(q.detach(), before)


def test_cat_and_pad_with_symbolic_sizes_reuse_one_kernel():
    """Sizes along the cat and pad dims vary between calls: one symbolic trace, its kernels
    read the sizes (masks, shifts) from the call."""
    def fn(x, y):
        return torch.cat((x.neg(), y), dim=1) * 2, F.pad(x + 1, (1, 2), value=-3.0)

    jfn = fulmen.jit(fn, executors=EXECUTORS, dynamic=True)
    for n, m in ((5, 3), (7, 4), (9, 2), (4, 6)):
        x, y = torch.randn(3, n), torch.randn(3, m)
        for actual, expected in zip(jfn(x, y), fn(x, y), strict=True):
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    ops = _fused_ops(jfn)
    assert "prims.cat(" in ops and "prims.pad(" in ops
    assert fulmen.compile_stats(jfn).cache_misses <= 2


def test_pad_and_cat_are_not_fused_on_cuda_or_in_row_kernels():
    """The CUDA renderer has no masked loads: pad and cat are not fusible there. A region with
    a reduction (the row schedule) refuses them: the pad runs in a pointwise kernel of its own
    and the sum in a row kernel."""
    def fn(x):
        return F.pad(x.exp(), (1, 1)).sum(-1)

    jfn = fulmen.jit(fn, executors=EXECUTORS)
    x = torch.randn(3, 4)
    torch.testing.assert_close(jfn(x), fn(x))
    pads = [sub for bsym in fulmen.last_traces(jfn)[0].bsyms for sub in bsym.subsymbols
            if sub.sym.name == "pad"]
    assert pads and not CUDA.selects and not fusible(pads[0], CUDA)
    fusions = [b for b in fulmen.last_traces(jfn)[-1].bsyms if "fusion" in b.sym.name]
    for fusion in fusions:
        names = {sub.sym.name for sub in fusion.subsymbols}
        assert not ({"pad", "sum"} <= names)


def test_lowering_rules():
    """fits_pointwise and lower agree: a lazy value (another shape) must be read by a pad or
    cat of the region, and must not leave it."""
    jfn = fulmen.jit(lambda x: torch.cat((x[:, :2].neg(), x[:, 2:]), 1), executors=EXECUTORS)
    jfn(torch.randn(3, 5))
    region = [sub for bsym in fulmen.last_traces(jfn)[0].bsyms for sub in bsym.subsymbols]
    region = [b for b in region if b.sym.name in ("slice", "neg", "cat")]
    assert fits_pointwise(region)
    lowered = lower(region, [region[-1].output])
    assert "mask" in str(lowered.kernel) and " if v" in str(lowered.kernel)
    without_cat = region[:-1]  # the negated slice alone: its own shape, a plain kernel
    assert fits_pointwise(without_cat)


def _selects(x, b):
    y = torch.cat(((x * b)[:, 2:].neg(), x[:, :2]), dim=1)  # a slice of a computed value
    z = F.pad(x.t()[1:].exp(), (0, 0, 1, 0)) + y  # a padded lazy value of another shape
    w = torch.cat((y, z), 0)[1:] * 2  # a view of a cat's result
    return w, b.exp()


def test_fast_pointwise_check_agrees_with_lowering_of_pads_and_cats():
    """The partitioner's `fits_pointwise` answers as `lower` does for every contiguous run of
    statements of a program with pads, cats, lazy values and views of computed values."""
    assert_pointwise_check_agrees_with_lowering(_selects, torch.randn(4, 4), torch.randn(4))
    x, b = torch.randn(4, 4), torch.randn(4)
    fused = fulmen.jit(_selects, executors=EXECUTORS)
    for actual, expected in zip(fused(x, b), _selects(x, b), strict=True):
        torch.testing.assert_close(actual, expected)


def test_a_cpu_cat_of_views_only_runs_on_torch():
    # nothing computed: the kernel read every operand, masked, at every element (GPT-2's qkv
    # gradient, 4x torch's copies and cat); a cat with a computed operand still fuses
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 8, 16)

    def moves(q, k):
        return torch.cat((q.permute(0, 3, 1, 2).reshape(2, 8, 64), k.transpose(1, 2)
                          .reshape(2, 8, 64)), dim=2)

    jfn = fulmen.jit(moves, executors=EXECUTORS)
    assert torch.equal(jfn(q, k), moves(q, k))
    calls = [bsym.sym.python_name for bsym in fulmen.last_traces(jfn)[-1].bsyms]
    assert "torch.cat" in calls and not any(c.startswith("codegen.") for c in calls), calls
    _check(lambda q, k: torch.cat((q.permute(0, 3, 1, 2).reshape(2, 8, 64).neg(),
                                   k.transpose(1, 2).reshape(2, 8, 64)), dim=2), q, k)


def test_a_computed_cat_operand_read_after_the_region_stays_out_of_the_cats_region():
    """A value computed only where a cat reads it (a lazy value, of another shape) cannot also
    leave the kernel: the partitioner asks codegen with `escapes`, so the negated slice read
    again after the cat gets a region of its own instead of making the merged region
    unlowerable (slice, neg, cat and mul all ran on torch)."""
    def fn(x):
        y = x[:, :2].neg()
        return torch.cat((y, x[:, 2:]), 1) * 2, y.exp()

    jfn = _check(fn, torch.randn(4, 6), rtol=1e-6, atol=1e-6)
    calls = [bsym.sym.python_name for bsym in fulmen.last_traces(jfn)[-1].bsyms]
    kept = [c for c in calls if c != "del"]
    assert len(kept) == 2 and all(c.startswith("codegen.fusion") for c in kept), calls
