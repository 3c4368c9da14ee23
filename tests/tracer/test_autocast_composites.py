"""Composite ops under CPU `torch.autocast`: values, dtypes and gradients are eager's.

Autocast casts the arguments of `linear`, `bmm`, ... also when a composite op calls them on
tensors it makes: `torch.gru` / `rnn_tanh` / `lstm` (whose CPU kernels call `linear` per step),
the cross-attention `F.multi_head_attention_forward` (whose `_in_projection_packed` slices the
packed weight), `torch.einsum` / `tensordot` / `inner` (which reshape, then call `bmm`) and
`F.bilinear` (whose kernel calls `bmm`). Recording only casts of the op's arguments, the compiled
call raised a dtype error (the RNNs, attention), returned float32 where eager returns bfloat16
(einsum), or computed in float32 what eager computes in bfloat16 (bilinear, off by ~3e-2). Such
calls now run whole inside autocast (NOTE [autocast inside an op]).
"""

import pytest
import torch
import torch.nn.functional as F

import fulmen

_MODULES = {
    "gru": (lambda: torch.nn.GRU(4, 5), lambda: (torch.randn(3, 2, 4),)),
    "rnn_tanh": (lambda: torch.nn.RNN(4, 5), lambda: (torch.randn(3, 2, 4),)),
    "lstm": (lambda: torch.nn.LSTM(4, 5), lambda: (torch.randn(3, 2, 4),)),
    "cross_attention": (lambda: torch.nn.MultiheadAttention(8, 2),
                        lambda: (torch.randn(5, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8))),
    "decoder_layer": (lambda: torch.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0),
                      lambda: (torch.randn(5, 2, 8), torch.randn(3, 2, 8))),
}

_FUNCTIONS = {
    "einsum": lambda a, b: torch.einsum("ij,jk->ik", a, b),
    "tensordot": lambda a, b: torch.tensordot(a, b, 1),
    "inner": lambda a, b: torch.inner(a, b).exp(),
    "bilinear": lambda a, b: F.bilinear(a, a, b.reshape(1, 8, 8)),
}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _run(fn, inputs, dtype):
    """Outputs, and gradients of their float32 sum for `inputs`, of `fn` under CPU autocast."""
    with torch.autocast("cpu", dtype=dtype):
        out = fn(*inputs)
    outputs = _tensors(out)
    loss = sum(o.float().sum() for o in outputs if o.is_floating_point())
    return outputs, torch.autograd.grad(loss, inputs)


def _assert_as_eager(fn, jfn, inputs, dtype):
    want, want_grads = _run(fn, inputs, dtype)
    got, got_grads = _run(jfn, inputs, dtype)
    assert fulmen.compile_stats(jfn).eager_calls == 0  # the compiled path, not eager's
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for g, w in zip(got + list(got_grads), want + list(want_grads), strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)


# float16 for one RNN and one attention only (test time)
_MODULE_CASES = [(case, torch.bfloat16) for case in sorted(_MODULES)] + [
    ("gru", torch.float16), ("cross_attention", torch.float16)]


def _module_grads(outputs, leaves):
    return torch.autograd.grad(sum(o.float().sum() for o in outputs), leaves)


@pytest.mark.parametrize(("case", "dtype"), _MODULE_CASES, ids=str)
def test_composite_module_under_cpu_autocast_is_eagers(case, dtype):
    make, inputs = _MODULES[case]
    torch.manual_seed(0)
    module = make()
    args = [t.requires_grad_() for t in inputs()]
    jmodule = fulmen.jit(module)
    _assert_module_as_eager(module, jmodule, args, dtype, cache_enabled=True)


def _assert_module_as_eager(module, jmodule, args, dtype, cache_enabled):
    with torch.autocast("cpu", dtype=dtype, cache_enabled=cache_enabled):
        want = _tensors(module(*args))
        got = _tensors(jmodule(*args))
    assert fulmen.compile_stats(jmodule).eager_calls == 0
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    leaves = [*args, *module.parameters()]
    for g, w in zip(_module_grads(got, leaves), _module_grads(want, leaves), strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)


def test_rnn_under_autocast_casts_its_weights_as_the_regions_cache_says():
    # With the cast cache (the default) eager casts the GRU's weights once for all steps and
    # adds their bfloat16 gradients; without it each step's cast has its own: gradients
    # rounded otherwise (~2e-3 apart). A call in each state runs its own trace.
    torch.manual_seed(0)
    module = torch.nn.GRU(4, 5)
    jmodule = fulmen.jit(module)
    args = [torch.randn(6, 2, 4, requires_grad=True)]
    for cache_enabled in (True, False, True):
        _assert_module_as_eager(module, jmodule, args, torch.bfloat16, cache_enabled)


@pytest.mark.parametrize("case", sorted(_FUNCTIONS))
def test_op_autocast_reaches_inside_is_eagers(case):
    fn = _FUNCTIONS[case]
    torch.manual_seed(0)
    inputs = (torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True))
    _assert_as_eager(fn, fulmen.jit(fn), inputs, torch.bfloat16)


def test_ops_autocast_casts_only_at_entry_keep_their_explicit_casts():
    # `linear` and `matmul` are cast by autocast on entry: the trace records the casts and the
    # ops as themselves (fusible, decomposed), not run whole inside autocast. Autocast's own
    # queries during the call (`prim.device`) once made every cast op look reached inside.
    def fn(x, w):
        return (F.linear(x, w).relu() @ w).exp()

    jfn = fulmen.jit(fn)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = fn(x, w), jfn(x, w)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    printed = str(fulmen.last_traces(jfn)[0])
    assert "ltorch.linear(" in printed and "ltorch.to(" in printed
    assert "_autocast_cpu" not in printed
