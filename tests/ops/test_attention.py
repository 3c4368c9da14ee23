"""attention.py: F.scaled_dot_product_attention decomposed, against eager's fused kernel."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.transforms import decompose_to_prims
from tests.ops.opinfo_harness import assert_traced_like_eager
from tests.spies import record_calls

MASK = torch.rand(3, 5) > 0.4
MASK[1] = False  # a fully masked query row: zeros, as eager

CASES = [dict(), dict(is_causal=True), dict(attn_mask=MASK), dict(attn_mask=torch.randn(2, 1, 3, 5)),
         dict(scale=0.3, attn_mask=MASK)]


@pytest.mark.parametrize("mode", [[], [decompose_to_prims]])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_sdpa(index, mode):
    kwargs = CASES[index]
    q = torch.randn(2, 2, 3, 4, requires_grad=True)
    k = torch.randn(2, 2, 5, 4, requires_grad=True)
    v = torch.randn(2, 2, 5, 6, requires_grad=True)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
    jfn = fulmen.jit(fn, transforms=mode)
    expected, actual = fn(q, k, v), jfn(q, k, v)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    for a, e in zip(torch.autograd.grad(actual, (q, k, v), cotangent),
                    torch.autograd.grad(expected, (q, k, v), cotangent)):
        torch.testing.assert_close(a, e)
    assert "opaque" not in str(fulmen.last_traces(jfn)[0])


def test_sdpa_with_dropout_off_the_cpu_path_runs_whole():
    """`dropout_p=1` (eager zeroes without drawing) is not decomposed; values equal eager."""
    q = torch.randn(1, 2, 4)
    fn = lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=1.0)  # noqa: E731
    jfn = fulmen.jit(fn)
    torch.manual_seed(0)
    expected = fn(q)
    torch.manual_seed(0)
    torch.testing.assert_close(jfn(q), expected)
    assert "opaque" in str(fulmen.last_traces(jfn)[0])


DROPOUT_CASES = [dict(attn_mask=MASK), dict(is_causal=True), dict(),
                 dict(attn_mask=torch.randn(2, 1, 3, 5), scale=0.3), dict(enable_gqa=True)]


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3)])
@pytest.mark.parametrize("index", range(len(DROPOUT_CASES)))
def test_sdpa_with_dropout_draws_eagers_mask(index, order, grad):
    """NOTE [attention dropout]: on CPU the call is decomposed with eager's dropout mask (the
    same draws from the global generator), and differentiated through that mask: values,
    strides, gradients and the generator's state after the call equal eager's, call after
    call (GPT-2's attention in training)."""
    kwargs = DROPOUT_CASES[index]
    heads = 2 if kwargs.get("enable_gqa") else 4

    def fn(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, **kwargs)
        return out * out.stride(1)

    jfn = fulmen.jit(fn)
    for seed in range(3):
        shape = (2, 4, 3, 4)
        q = torch.randn([shape[d] for d in order]).permute(*[order.index(d) for d in range(4)])
        q.requires_grad_(grad)
        k = torch.randn(2, heads, 5, 4, requires_grad=grad)
        v = torch.randn(2, heads, 5, 6, requires_grad=grad)
        torch.manual_seed(seed)
        expected = fn(q, k, v)
        after_eager = torch.rand(4)
        torch.manual_seed(seed)
        actual = jfn(q, k, v)
        torch.testing.assert_close(torch.rand(4), after_eager)
        # float32 attention computed in another order, then scaled by `fn`'s stride factor: a
        # clean-clone `make test` saw 1.9e-5 off in 1 of 144 elements (3e-5 relative) with
        # the default tolerance's atol unscaled; another mask would be off by O(1) times it
        scale = expected.stride(1)
        torch.testing.assert_close(actual, expected, rtol=1.3e-6, atol=1e-5 * scale)
        assert actual.stride() == expected.stride()
        if grad:
            cotangent = torch.randn_like(expected)
            # float32 gradients summed in another order (a fused kernel's, or torch's before
            # the kernel is built): a clean-clone `make test` saw 1.4e-5 off in 1 of 160
            # elements (8e-6 relative); another mask would be off by O(1)
            for a, e in zip(torch.autograd.grad(actual, (q, k, v), cotangent),
                            torch.autograd.grad(expected, (q, k, v), cotangent)):
                torch.testing.assert_close(a, e, rtol=1e-5, atol=3e-5)
    trace = str(fulmen.last_traces(jfn)[0])
    assert "opaque" not in trace and "bernoulli" in trace


@pytest.mark.parametrize("mode", [[], [decompose_to_prims]])
@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(attn_mask=MASK)])
def test_grouped_query_attention_is_decomposed(kwargs, mode):
    """`enable_gqa=True` (HF Llama/Qwen2 with fewer key/value heads): each key/value head
    serves consecutive query heads, as eager's `repeat_interleave`."""
    q = torch.randn(2, 4, 3, 4, requires_grad=True)
    k = torch.randn(2, 2, 5, 4, requires_grad=True)
    v = torch.randn(2, 2, 5, 4, requires_grad=True)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True,  # noqa: E731
                                                        **kwargs)
    jfn = fulmen.jit(fn, transforms=mode)
    expected, actual = fn(q, k, v), jfn(q, k, v)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    for a, e in zip(torch.autograd.grad(actual, (q, k, v), cotangent),
                    torch.autograd.grad(expected, (q, k, v), cotangent)):
        torch.testing.assert_close(a, e)
    assert "opaque" not in str(fulmen.last_traces(jfn)[0])


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3), (2, 0, 1, 3), (1, 2, 0, 3)])
def test_output_strides_are_eagers(order, dynamic):
    """On CPU eager's flash kernel allocates the output like the query: a query laid out as
    (batch, seq, heads, dim) (HF's `view(...).transpose(1, 2)`) gives a transposed output."""
    def fn(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
        return out * out.stride(1) + out.stride(2)

    jfn = fulmen.jit(fn, dynamic=dynamic)
    for seq in (5, 7):
        shape = (2, 4, seq, 8)
        q = torch.randn([shape[d] for d in order]).permute(*[order.index(d) for d in range(4)])
        k, v = torch.randn(2, 2, seq, 8), torch.randn(2, 2, seq, 8)
        torch.testing.assert_close(jfn(q, k, v), fn(q, k, v))


def test_sdpa_with_dropout_and_symbolic_sizes():
    """The dropout mask of a symbolic-size call is drawn at the call's sizes: one compilation
    serves three sequence lengths, each equal to eager."""
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.2,  # noqa: E731
                                                        is_causal=True)
    jfn = fulmen.jit(fn, dynamic=True)
    for seq in (5, 7, 9):
        q, k, v = (torch.randn(2, 2, seq, 4, requires_grad=True) for _ in range(3))
        torch.manual_seed(seq)
        expected = fn(q, k, v)
        torch.manual_seed(seq)
        actual = jfn(q, k, v)
        torch.testing.assert_close(actual, expected)
        for a, e in zip(torch.autograd.grad(actual.sum(), (q, k, v)),
                        torch.autograd.grad(expected.sum(), (q, k, v))):
            torch.testing.assert_close(a, e)
    assert fulmen.compile_stats(jfn).cache_misses == 1


def _gpt2_query(batch, seq):
    """(batch, 2, seq, 8) read out of a (batch, seq, 48) projection: GPT-2's split and
    transpose, a query that is no dense tensor."""
    qkv = torch.randn(batch, seq, 48)
    return qkv[..., :16].view(batch, seq, 2, 8).transpose(1, 2)


_QUERIES = {
    "contiguous": lambda b, s: torch.randn(b, 2, s, 8),
    "transposed": lambda b, s: torch.randn(b, s, 2, 8).transpose(1, 2),
    "split": _gpt2_query,
}
_MASKS = {
    "none": lambda b, s: None,
    "bool": lambda b, s: torch.ones(s, s, dtype=torch.bool).tril(),
    "float": lambda b, s: torch.randn(b, 1, s, s),
}


@pytest.mark.parametrize("mask", list(_MASKS))
@pytest.mark.parametrize("query", list(_QUERIES))
@pytest.mark.parametrize("batch", [1, 3])
def test_symbolic_attention_run_whole_is_described_as_the_meta_kernel_does(batch, query, mask):
    """`opaque.attention_like_query`: with symbolic sizes, attention run whole (dropout) gets
    the output PyTorch's meta kernel describes (shape, dtype, strides), without running that
    kernel's math backend on fake tensors (0.4 s per call)."""
    from fulmen.ops import opaque
    from fulmen.ops.meta import run_meta
    from fulmen.proxies import TensorProxy
    from fulmen.proxies.tensor import known_same_shape
    from fulmen.tracer.symbolic import SymbolicSizes

    sizes = SymbolicSizes()

    def proxy(tensor, name, dims):
        if tensor is None:
            return None
        shape, strides = sizes.symbolize(tensor, name, dims)
        if shape == tuple(tensor.shape):  # a view keeps its sizes: stand in with its layout
            strides = tensor.stride()
        return TensorProxy(name, shape, tensor.dtype, "cpu", strides=strides)

    seq = 6
    q = _QUERIES[query](batch, seq)
    q = proxy(q.contiguous(), "q", (0, 2)) if query == "contiguous" else proxy(q, "q", ())
    k = proxy(torch.randn(batch, 2, seq, 8), "k", (0, 2))
    v = proxy(torch.randn(batch, 2, seq, 8), "v", (0, 2))
    m = proxy(_MASKS[mask](batch, seq), "m", ())
    kwargs = dict(attn_mask=m, dropout_p=0.3, is_causal=mask == "none")
    fast = opaque.attention_like_query((q, k, v), kwargs)
    if query == "contiguous" or batch > 1:
        assert fast is not None
    if fast is None:
        return  # nothing symbolic that the call's result shape could read without a guard
    meta = run_meta(F.scaled_dot_product_attention, q, k, v, **kwargs)
    assert fast.dtype == meta.dtype
    assert known_same_shape(fast.shape, meta.shape)
    assert known_same_shape(fast.stride(), meta.stride())


_LAYOUTS = {  # the query made inside the traced function from a contiguous input
    "contiguous": lambda x: x[..., :16].reshape(x.shape[0], x.shape[1], 2, 8).permute(0, 2, 1, 3)
    .contiguous(),
    "transposed": lambda x: x[..., :16].reshape(x.shape[0], x.shape[1], 2, 8).transpose(1, 2),
    "split": lambda x: x.split(16, dim=-1)[0].view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2),
}


@pytest.mark.parametrize("query", list(_LAYOUTS))
def test_attention_with_dropout_over_symbolic_lengths_equals_eager(query):
    """GPT-2's training attention (dropout, a query split out of a projection) over varying
    lengths: eager's values and gradients, and the strides user code reads, with two
    compilations."""
    def fn(x, k, v):
        q = _LAYOUTS[query](x)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)
        return out * out.stride(1) + out.stride(2)

    jfn = fulmen.jit(fn)
    for seq in (5, 7, 9, 12):
        x = torch.randn(2, seq, 48, requires_grad=True)
        k, v = torch.randn(2, 2, seq, 8, requires_grad=True), torch.randn(2, 2, seq, 8)
        torch.manual_seed(seq)
        expected = fn(x, k, v)
        torch.manual_seed(seq)
        actual = jfn(x, k, v)
        # decomposed on CPU (NOTE [attention dropout]): float32 rounding, scaled by the stride
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)
        cotangent = torch.randn_like(expected)
        for a, e in zip(torch.autograd.grad(actual, (x, k), cotangent),
                        torch.autograd.grad(expected, (x, k), cotangent)):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4)
    assert fulmen.cache_misses(jfn) == 2


@pytest.mark.parametrize("query", list(_LAYOUTS))
def test_dropout_attention_with_symbolic_sizes_is_laid_out_without_the_meta_kernel(
        query, monkeypatch):
    """The decomposed dropout attention's layout (NOTE [layout truth]) is described by
    `layout._attention_layouts` where its sizes are symbolic, not by PyTorch's meta kernel
    (`eager_layouts`, which runs the math backend op by op on fake tensors); strides and values
    stay eager's (`test_attention_with_dropout_over_symbolic_lengths_equals_eager`)."""
    from fulmen.tracer import layout_truth

    asked = record_calls(monkeypatch, layout_truth, "eager_layouts")

    def fn(x, k, v):
        q = _LAYOUTS[query](x)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)
        return out * out.stride(1) + out.stride(2)

    jfn = fulmen.jit(fn)
    for seq in (5, 7, 9):
        x = torch.randn(2, seq, 48, requires_grad=True)
        k, v = torch.randn(2, 2, seq, 8, requires_grad=True), torch.randn(2, 2, seq, 8)
        torch.manual_seed(seq)
        expected = fn(x, k, v)
        torch.manual_seed(seq)
        torch.testing.assert_close(jfn(x, k, v), expected, rtol=1e-5, atol=1e-4)
        if seq == 5:
            asked.clear()  # the static trace may ask it: its meta kernel is cheap
    assert fulmen.cache_misses(jfn) == 2
    assert F.scaled_dot_product_attention not in asked


@pytest.mark.parametrize("dim, dtype", [(-1, None), (0, None), (1, torch.float64)])
def test_safe_softmax_equals_eager_with_its_vjp(dim, dtype):
    """`torch._safe_softmax` (eager's softmax inside attention): values and gradients equal
    eager's, fully masked rows giving zeros (and zero gradients: softmax's VJP of the output);
    the op is decomposed (it ran opaquely under torch.autograd)."""
    x = torch.randn(3, 5, 4)
    x[0, 1] = -torch.inf  # a row of all -inf along dim=-1 and (in part) along the others
    x[:, 2, :] = -torch.inf
    x.requires_grad_()
    fn = lambda x: torch._safe_softmax(x, dim, dtype)  # noqa: E731
    assert_traced_like_eager(fn, x)


@pytest.mark.parametrize("kwargs", [dict(attn_mask=MASK), dict(is_causal=True)])
def test_dropout_attention_backward_does_not_recompute_the_softmax(kwargs):
    """Attention with dropout is differentiated through its decomposition (NOTE [attention
    dropout]); its softmax is `torch._safe_softmax`, whose VJP reads the kept weights: the
    backward recomputes no max or exp of the scores (it did, transposing each prim)."""
    q, k, v = (torch.randn(2, 4, 3 if i == 0 else 5, 4, requires_grad=True) for i in range(3))
    jfn = fulmen.jit(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.3,
                                                                    **kwargs))
    jfn(q, k, v).sum().backward()
    backward = str(fulmen.last_backward_traces(jfn)[-1])
    assert "amax" not in backward and "exp" not in backward
