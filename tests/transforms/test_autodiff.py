"""Autodiff: prim VJP rules against torch.autograd.gradcheck, and the autograd integration."""

import pytest
import torch

import fulmen
from fulmen.ops import prims
from fulmen.transforms.autodiff import has_rule

D = torch.float64


def _pos(*shape):
    return torch.rand(*shape, dtype=D) + 0.5


def _any(*shape):
    return torch.randn(*shape, dtype=D)


def _unit(*shape):
    return torch.rand(*shape, dtype=D) * 1.6 - 0.8


UNARY_DOMAINS = {
    "exp": _any, "exp2": _any, "expm1": _any, "log": _pos, "log1p": _pos, "log2": _pos,
    "log10": _pos, "sqrt": _pos, "rsqrt": _pos, "sin": _any, "cos": _any, "tan": _unit,
    "asin": _unit, "acos": _unit, "atan": _any, "sinh": _any, "cosh": _any, "tanh": _any,
    "asinh": _any, "acosh": lambda *s: _pos(*s) + 1.0, "atanh": _unit, "erf": _any,
    "erfc": _any, "erfinv": _unit, "lgamma": _pos, "reciprocal": _pos, "abs": _pos,
    "neg": _any,
}  # fmt: skip

BINARY_DOMAINS = {
    "add": (_any, _any), "sub": (_any, _any), "mul": (_any, _any), "div": (_any, _pos),
    "pow": (_pos, _any), "maximum": (_any, _any), "minimum": (_any, _any),
    "atan2": (_any, _pos), "remainder": (_pos, _pos), "fmod": (_pos, _pos),
}  # fmt: skip


def _gradcheck(fn, *inputs, executors=None, **options):
    inputs = [t.requires_grad_() for t in inputs]
    jfn = fulmen.jit(fn, executors=executors, **options)
    assert torch.autograd.gradcheck(jfn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)
    return jfn


@pytest.mark.parametrize("name", sorted(UNARY_DOMAINS))
def test_unary_prim_rules_gradcheck(name):
    prim = getattr(prims, name)
    assert has_rule(prim)
    _gradcheck(lambda a: prim(a), UNARY_DOMAINS[name](3, 4))


@pytest.mark.parametrize("name", sorted(BINARY_DOMAINS))
def test_binary_prim_rules_gradcheck(name):
    prim = getattr(prims, name)
    make_a, make_b = BINARY_DOMAINS[name]
    _gradcheck(lambda a, b: prim(a, b), make_a(3, 4), make_b(3, 4))
    _gradcheck(lambda a: prim(a, 1.5), make_a(3, 4))  # a number operand gets no cotangent


STRUCTURAL = {
    "broadcast_in_dim": (lambda a: prims.broadcast_in_dim(a, (2, 3, 4), (0, 2)), (2, 1)),
    "reshape": (lambda a: prims.reshape(a, (4, 3)), (3, 4)),
    "squeeze": (lambda a: prims.squeeze(a, (1,)), (3, 1, 4)),
    "permute": (lambda a: prims.permute(a, (2, 0, 1)), (2, 3, 4)),
    "slice": (lambda a: prims.slice_prim(a, (1, 0), (5, 4), (2, 3)), (6, 4)),
    "pad": (lambda a: prims.pad(a, 0.5, ((1, -1, 1), (0, 2, 0))), (3, 4)),
    "flip": (lambda a: prims.flip(a, (0,)), (3, 4)),
    "sum": (lambda a: prims.sum(a, (0, 2)), (2, 3, 4)),
    "prod": (lambda a: prims.prod(a, (1,)), (3, 4)),
    "amax": (lambda a: prims.amax(a, (1,)), (3, 4)),
    "amin": (lambda a: prims.amin(a, (0,)), (3, 4)),
    "var": (lambda a: prims.var(a, (1,), 1), (3, 4)),
    "where": (lambda a: prims.where(prims.gt(a, 0), a, prims.mul(a, 3.0)), (3, 4)),
}


@pytest.mark.parametrize("name", sorted(STRUCTURAL))
def test_structural_prim_rules_gradcheck(name):
    fn, shape = STRUCTURAL[name]
    _gradcheck(fn, _any(*shape))


def test_cat_matmul_linear_embedding_take_along_dim_rules():
    _gradcheck(lambda a, b: prims.cat([a, b], 1), _any(2, 3), _any(2, 2))
    _gradcheck(lambda a, b: prims.matmul(a, b), _any(2, 3, 4), _any(4, 5))
    _gradcheck(lambda a, b: prims.matmul(a, b), _any(2, 3, 4), _any(2, 4, 5))
    _gradcheck(lambda a, b: prims.matmul(a, b), _any(4), _any(4, 5))  # falls back to autograd
    _gradcheck(lambda a, w, b: prims.linear(a, w, b), _any(2, 3, 4), _any(5, 4), _any(5))
    index = torch.tensor([[0, 2, 2], [1, 1, 0]])
    _gradcheck(lambda w: prims.embedding(index, w), _any(3, 4))
    _gradcheck(lambda a: prims.take_along_dim(a, index, 1), _any(2, 3))
    _gradcheck(lambda a, s: prims.scatter_add(a, 1, index, s), _any(2, 3), _any(2, 3))


def test_convert_element_type_rule_returns_the_input_dtype():
    x = torch.randn(3, dtype=D, requires_grad=True)
    out = fulmen.jit(lambda a: prims.convert_element_type(a, torch.float32) * 2)(x)
    out.sum().backward()
    assert x.grad.dtype == D
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0, dtype=D))


def test_ties_share_the_gradient_like_eager():
    x = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], requires_grad=True)
    fulmen.jit(lambda a: prims.amax(a, (1,)))(x).sum().backward()
    expected = x.detach().clone().requires_grad_()
    torch.amax(expected, 1).sum().backward()
    torch.testing.assert_close(x.grad, expected.grad)


def test_opaque_ops_are_differentiable():
    def fn(x):
        return torch.special.i0(torch.cumsum(x, 0)).sum()

    _gradcheck(fn, _any(5) * 0.3)


def test_module_training_steps_match_eager():
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    compiled = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    compiled.load_state_dict(eager.state_dict())
    jmodel = fulmen.jit(compiled)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_j = torch.optim.AdamW(jmodel.parameters(), lr=1e-2)
    for _ in range(5):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        for model, opt in ((eager, opt_e), (jmodel, opt_j)):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
    for p_e, p_j in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(p_j, p_e, rtol=1e-4, atol=1e-5)
    assert fulmen.cache_misses(jmodel) == 1


def test_gradient_accumulation_hooks_and_retain_graph():
    w = torch.randn(3, requires_grad=True)
    seen = []
    w.register_hook(lambda g: seen.append(g.clone()))
    jfn = fulmen.jit(lambda x, w: (x * w).sin().sum())
    x = torch.randn(3)
    loss = jfn(x, w)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = 2 * x * torch.cos(x * w.detach())
    torch.testing.assert_close(w.grad, expected)
    assert len(seen) == 2


def test_outputs_without_grad_and_integer_outputs():
    def fn(x, y):
        return x * 2, (x > 0), y + 1

    x = torch.randn(3, requires_grad=True)
    a, mask, c = fulmen.jit(fn)(x, torch.ones(3))
    assert a.requires_grad and not mask.requires_grad and not c.requires_grad
    a.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_unused_output_cotangent_and_torch_autograd_grad():
    def fn(x):
        return x.exp(), x.sin()

    x = torch.randn(4, requires_grad=True)
    first, _ = fulmen.jit(fn)(x)
    (grad,) = torch.autograd.grad(first.sum(), x)
    torch.testing.assert_close(grad, x.exp().detach())


def test_grad_and_value_and_grad_are_one_trace():
    def loss(x, w):
        return (torch.tanh(x @ w) ** 2).mean()

    x, w = torch.randn(4, 3), torch.randn(3, 2)
    value, (gx, gw) = fulmen.value_and_grad(loss, argnums=(0, 1))(x, w)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = loss(xe, we)
    expected.backward()
    torch.testing.assert_close(value, expected.detach())
    torch.testing.assert_close(gx, xe.grad)
    torch.testing.assert_close(gw, we.grad)
    dw = fulmen.grad(loss, argnums=1)
    torch.testing.assert_close(dw(x, w), we.grad)
    traces = fulmen.last_traces(dw.__wrapped__)
    assert any("value and grad" in t.provenance for t in traces)


def test_grad_of_pytree_argument_and_unused_input():
    def loss(params, x):
        return (params["a"] * x).sum()

    params = {"a": torch.randn(3), "b": torch.randn(2)}
    grads = fulmen.grad(loss)(params, torch.ones(3))
    torch.testing.assert_close(grads["a"], torch.ones(3))
    torch.testing.assert_close(grads["b"], torch.zeros(2))


def test_grad_requires_scalar_output():
    with pytest.raises(fulmen.FulmenError, match="one\nelement|one element"):
        fulmen.grad(lambda x: x * 2)(torch.randn(3))


def test_vjp_matches_autograd():
    def fn(x, w):
        return torch.sin(x) * w, x.sum()

    x, w = torch.randn(3), torch.randn(3)
    (out, total), vjp_fn = fulmen.vjp(fn, x, w)
    torch.testing.assert_close(out, torch.sin(x) * w)
    cotangent = torch.randn(3)
    gx, gw = vjp_fn((cotangent, torch.tensor(2.0)))
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.autograd.backward(fn(xe, we), (cotangent, torch.tensor(2.0)))
    torch.testing.assert_close(gx, xe.grad)
    torch.testing.assert_close(gw, we.grad)



def test_vjp_gives_each_primal_its_gradient_after_a_number():
    # a number before the tensors: its gradient is None and each tensor keeps its own
    def fn(scale, x, w):
        return torch.sin(x) * w * scale

    x, w = torch.randn(3), torch.randn(3)
    out, vjp_fn = fulmen.vjp(fn, 2.0, x, w)
    cotangent = torch.randn(3)
    g_scale, gx, gw = vjp_fn(cotangent)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    fn(2.0, xe, we).backward(cotangent)
    assert g_scale is None
    torch.testing.assert_close(gx, xe.grad)
    torch.testing.assert_close(gw, we.grad)


def test_dropout_in_training_reuses_its_mask_in_backward():
    import torch.nn.functional as F

    x = torch.randn(32, 16, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    jfn = fulmen.jit(lambda t: (F.dropout(t, 0.4) * t).sum())
    torch.manual_seed(7)
    loss = jfn(x)
    loss.backward()
    torch.manual_seed(7)
    expected = (F.dropout(xe, 0.4) * xe).sum()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(x.grad, xe.grad, rtol=0, atol=0)


COMPOSITES = {
    "softmax": (lambda x: torch.softmax(x, -1) * torch.arange(4.0, dtype=D), (3, 4)),
    "F.softmax": (lambda x: torch.nn.functional.softmax(x, dim=0), (3, 4)),
    "log_softmax": (lambda x: x.log_softmax(1) * x, (3, 4)),
    "F.log_softmax": (lambda x: torch.nn.functional.log_softmax(x, dim=-1), (2, 3, 4)),
    "layer_norm": (lambda x: torch.nn.functional.layer_norm(x, (4,)), (3, 4)),
}


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_composite_rules_gradcheck_and_keep_the_op_whole(name):
    fn, shape = COMPOSITES[name]
    jfn = _gradcheck(fn, _any(*shape), executors=["torch"])  # no fusion: the op stays whole
    forward = str(fulmen.last_traces(jfn)[-1])
    assert "prims" not in forward and "torchex.amax" not in forward


@pytest.mark.parametrize("dynamic", [False, True])
def test_layer_norm_rule_runs_eagers_kernels_on_static_cpu_sizes(dynamic):
    """Static CPU sizes: eager's `native_layer_norm_backward`; symbolic sizes: the composite
    formula (NOTE [layer norm backward])."""
    weight, bias = _any(4), _any(4)
    jfn = _gradcheck(lambda x, w, b: torch.nn.functional.layer_norm(x, (4,), w, b),
                     _any(2, 3, 4), weight, bias, dynamic=dynamic)
    backward = str(fulmen.last_backward_traces(jfn)[-1])
    assert ("native_layer_norm_backward" in backward) is not dynamic


def test_layer_norm_and_embedding_rules_with_weights():
    weight, bias = _any(4), _any(4)
    _gradcheck(lambda x, w, b: torch.nn.functional.layer_norm(x, (4,), w, b), _any(2, 3, 4),
               weight, bias)
    _gradcheck(lambda x, w: torch.nn.functional.layer_norm(x, (3, 4), w.reshape(3, 4)),
               _any(2, 3, 4), _any(12))
    ids = torch.tensor([[0, 2, 1], [2, 2, 0]])
    for padding_idx in (None, 2, -1):  # the padding row gets no gradient: not a derivative
        fn = lambda w, p=padding_idx: torch.nn.functional.embedding(ids, w, padding_idx=p)  # noqa: E731
        w = _any(3, 4).requires_grad_()
        cotangent = _any(2, 3, 4)
        (expected,) = torch.autograd.grad(fn(w), w, cotangent)
        jfn = fulmen.jit(fn)
        (actual,) = torch.autograd.grad(jfn(w), w, cotangent)
        # eager's kernel sums the repeated rows in eager's order: the same bits
        assert torch.equal(actual, expected), padding_idx
        assert "embedding_dense_backward" in str(fulmen.last_backward_traces(jfn)[-1])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_silu_use_eager_backward_kernels(approximate):
    jfn = _gradcheck(lambda x: torch.nn.functional.gelu(x, approximate=approximate), _any(3, 4),
                     executors=["torch"])
    assert "gelu_backward" in str(fulmen.last_backward_traces(jfn)[-1])
    _gradcheck(lambda x: torch.nn.functional.gelu(x, approximate=approximate), _any(3, 4))
    _gradcheck(lambda x: torch.nn.functional.silu(x), _any(3, 4))


def test_rms_norm_composite_rule():
    jfn = _gradcheck(lambda x, w: torch.nn.functional.rms_norm(x, (4,), w, 1e-6),
                     _any(2, 3, 4), _any(4))
    assert "rms_norm" in str(fulmen.last_traces(jfn)[-1])  # the forward keeps the op whole
    _gradcheck(lambda x: torch.nn.functional.rms_norm(x, (3, 4)), _any(2, 3, 4))


def test_rms_norm_default_eps_gradient_of_small_activations_is_eagers():
    # nn.RMSNorm's default eps=None is float32's machine epsilon (1.2e-7 for float32 and
    # half inputs); with activations of 1e-4 (mean square 1e-8) it is most of the
    # denominator, in the backward rule as in the forward
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(8)
    x = (torch.randn(3, 8) * 1e-4).requires_grad_()
    jnorm = fulmen.jit(norm)
    expected, actual = norm(x), jnorm(x)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, (x, norm.weight), cotangent),
                               torch.autograd.grad(expected, (x, norm.weight), cotangent))


@pytest.mark.parametrize("op", ["mul", "div", "exp", "sum"])
def test_complex_intermediates_differentiate_as_eager(op):
    # the prim rules are for real values; complex ones (HF Llama 4's rotary embedding) go
    # through torch.autograd, whose gradients conjugate (d(a*b)/da = grad * conj(b))
    def fn(x, w):
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        rotation = torch.polar(torch.ones_like(w), w)
        if op == "mul":
            z = z * rotation[:, None]
        elif op == "div":
            z = z / (rotation[:, None] + 2)
        elif op == "exp":
            z = (z * rotation[:, None] * 0.5).exp() + z
        else:
            z = (z + rotation[:, None]).sum(0) * 2
        return torch.view_as_real(z).flatten(-2)

    x = torch.randn(3, 2, 8, dtype=D, requires_grad=True)
    w = torch.randn(3, 4, dtype=D, requires_grad=True)
    expected, actual = fn(x, w), fulmen.jit(fn)(x, w)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, (x, w), cotangent),
                               torch.autograd.grad(expected, (x, w), cotangent))
