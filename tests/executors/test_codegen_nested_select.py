"""A pad or cat inside another one's operand in codegen's pointwise kernels (NOTE [a pad or cat
inside another one's operand] in `fulmen/executors/codegen/lower.py`), and the statements that
join their producer's region only together (NOTE [consumers that fit only together] in
`fulmen/transforms/fusion.py`): litgpt's partial rotary (pythia: 8 of 32 channels rotated)
writes q and k whole from one kernel. Values and strides against eager, forward and backward,
static and symbolic sizes.
"""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.executors.codegen.lower import Unsupported, fits_pointwise, lower
from fulmen.transforms import decompose_to_prims
from tests.transforms.test_fusion import assert_pointwise_check_agrees_with_lowering

pytestmark = pytest.mark.usefixtures("codegen_eager")

EXECUTORS = ["codegen", "torch"]


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _partial_rope(qkv, cos, sin):
    """litgpt's `apply_rope` on the first `n` channels of q and k, the rest passed through;
    cos and sin sliced to the sequence here, as litgpt's GPT.forward does."""
    b, t, _ = qkv.shape
    q, k = qkv.view(b, t, 2, 4, 12).permute(2, 0, 3, 1, 4).unbind(0)
    cos, sin = cos[:t], sin[:t]
    n = cos.shape[-1]
    q_roped = q[..., :n] * cos + _rotate_half(q[..., :n]) * sin
    k_roped = k[..., :n] * cos + _rotate_half(k[..., :n]) * sin
    return torch.cat((q_roped, q[..., n:]), dim=-1), torch.cat((k_roped, k[..., n:]), dim=-1)


def _fusions(trace) -> list:
    return [b for b in trace.bsyms if b.sym.name.startswith("fusion")]


def _calls(trace) -> list[str]:
    return [b.sym.python_name for b in trace.bsyms]


def _compare(jfn, fn, *args, grads=True, tol=0.0):
    """Values and strides of `jfn(*args)` against eager (within `tol`: the CPU target's
    `exp` and `sin` differ from eager's by an ulp), and the gradients of the arguments that
    require grad."""
    ref_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    actual, expected = jfn(*args), fn(*ref_args)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=tol, atol=tol)
        assert a.stride() == e.stride()
    if grads:
        cotangents = [torch.randn_like(e) for e in expected]
        torch.autograd.backward(actual, cotangents)
        torch.autograd.backward(expected, cotangents)
        for a, e in zip(args, ref_args, strict=True):
            if a.requires_grad:
                torch.testing.assert_close(a.grad, e.grad, rtol=1e-6, atol=1e-6)
                assert a.grad.stride() == e.grad.stride()


def test_partial_rotary_writes_q_and_k_whole_from_one_kernel_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 5, 96, generator=g).requires_grad_()
    angles = torch.randn(7, 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    jfn = fulmen.jit(_partial_rope, executors=EXECUTORS)
    _compare(jfn, _partial_rope, qkv, cos, sin)
    forward = fulmen.last_traces(jfn)[-1]
    assert "torch.cat" not in _calls(forward) and len(_fusions(forward)) == 1, forward
    inner = [s for s in _fusions(forward)[0].subsymbols if s.sym.name == "cat"]
    assert len(inner) == 4  # the two rotate_half cats inside the two outer ones
    with torch.no_grad():  # inference: the same single kernel
        _compare(jfn, _partial_rope, qkv.detach(), cos, sin, grads=False)
    assert len(_fusions(fulmen.last_traces(jfn)[-1])) == 1


def test_partial_rotary_with_a_symbolic_sequence_length_reuses_one_kernel():
    g = torch.Generator().manual_seed(1)
    angles = torch.randn(9, 2, generator=g).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    jfn = fulmen.jit(_partial_rope, executors=EXECUTORS, dynamic=True)
    for t in (3, 5, 8, 6):
        qkv = torch.randn(2, t, 96, generator=g).requires_grad_()
        _compare(jfn, _partial_rope, qkv, cos, sin)
    forward = fulmen.last_traces(jfn)[-1]
    assert "torch.cat" not in _calls(forward) and len(_fusions(forward)) == 1, forward
    assert fulmen.compile_stats(jfn).cache_misses <= 2


def _nested(x, y):
    """Cats and pads inside cats and pads: along the same dim, along another dim, with crops
    (negative widths), of transposed and broadcast operands."""
    inner = torch.cat((x[:, :3].exp(), y[:, :2] * 2), dim=1)  # (4, 5)
    across = torch.cat((inner * y[:, 1:6], F.pad(x[:2, 1:6], (0, 0, 1, 1), value=-2.0)), dim=0)
    padded = F.pad(torch.cat((x[:, 4:].neg(), y[:, :1]), dim=1) + 1, (2, -1), value=0.5)
    return torch.cat((across, F.pad(padded, (0, 2, 0, 4))), dim=1).sin(), y.t().cos()


def test_pads_and_cats_nested_along_every_dim_match_eager():
    x = torch.randn(6, 4).t()  # (4, 6), transposed
    y = torch.randn(4, 8).requires_grad_()
    jfn = fulmen.jit(_nested, executors=EXECUTORS)
    _compare(jfn, _nested, x, y, tol=1e-6)
    fused = [s.sym.name for f in _fusions(fulmen.last_traces(jfn)[-1]) for s in f.subsymbols]
    assert fused.count("cat") >= 3 and fused.count("pad") >= 2, fused


def test_fast_pointwise_check_agrees_with_lowering_of_nested_pads_and_cats():
    assert_pointwise_check_agrees_with_lowering(_nested, torch.randn(4, 6), torch.randn(4, 8))


def _prims(fn, *args) -> list:
    jfn = fulmen.jit(fn, executors=["torch"], transforms=[decompose_to_prims])
    jfn(*args)
    return [b for b in fulmen.last_traces(jfn)[1].bsyms if b.sym.is_prim and b.output is not None]


def test_a_nested_cat_read_through_a_view_or_leaving_the_region_is_refused():
    """An inner cat read at the outer one's place lowers; its result (of another shape)
    leaving the region, or read through a view, does not."""
    x = torch.randn(4, 6)
    region = _prims(lambda x: torch.cat((torch.cat((x.neg(), x), 1) + 1, x), 1), x)
    assert [b.sym.name for b in region] == ["neg", "cat", "add", "cat"]
    assert fits_pointwise(region)
    kernel = str(lower(region, [region[-1].output]).kernel)
    # the inner cat's masks laid over the outer one's space, and-ed with its piece's mask
    assert kernel.count("= mask.mask(") == 4 and "mask.mask(1, 6, 6, (4, 18))" in kernel
    assert ".shift((0, 6), (4, 12)).shift((0, 0), (4, 18))" in kernel and "o1" not in kernel
    with pytest.raises(Unsupported, match="leaves the kernel"):
        lower(region, [region[-1].output, region[1].output])
    viewed = _prims(lambda x: torch.cat((torch.cat((x.neg(), x), 1).t()[:6] * 2, x.t()), 1), x)
    assert [b.sym.name for b in viewed][:3] == ["neg", "cat", "permute"]
    assert not fits_pointwise(viewed)
    with pytest.raises(Unsupported):
        lower(viewed, [viewed[-1].output])
