"""The gradients `torch.autograd.grad` returns through a compiled program have eager's layouts
(NOTE [eager's gradient layouts] in `fulmen/transforms/autodiff/eager_replay.py`), and an
inference tensor eager would save for backward raises eager's error (NOTE [inference tensors
saved for backward])."""

import pytest
import torch
import torch.nn.functional as F

import fulmen

CL = torch.channels_last


def _mm(x, w):
    return x @ w


def _transposed_mm(x, w):
    return x.t() @ w


def _linear(x, w):
    return F.linear(x, w).relu()


def _mean(x):
    return x.mean((2, 3))


def _conv(x, w):
    return F.conv2d(x, w, padding=1).relu()


def _norm(x):
    return x.norm(dim=0)


def _mse(x, y):
    return F.mse_loss(x, y)


def _eval_batch_norm(x, weight):
    return F.batch_norm(x, torch.zeros(3), torch.ones(3), weight, training=False)


# name -> (program, inputs as (shape, layout)): each one's fulmen gradient had another layout
_CASES = {
    "mm_of_a_transposed_input": (_mm, [((4, 5), "t"), ((5, 3), "row")]),
    "transposed_use_of_a_row_major_input": (_transposed_mm, [((5, 4), "row"), ((5, 3), "row")]),
    "linear_of_a_transposed_weight": (_linear, [((4, 5), "row"), ((3, 5), "t")]),
    "mean_of_a_channels_last_input": (_mean, [((2, 3, 4, 5), "cl")]),
    "norm_of_a_transposed_input": (_norm, [((4, 5), "t")]),
    # PyTorch's meta kernels lay these out otherwise than its CPU kernels: a replay on fake
    # tensors gave the second a row-major gradient (eager's and fulmen's: channels-last)
    "mse_loss_of_a_transposed_input": (_mse, [((5, 4), "t"), ((5, 4), "row")]),
    "eval_batch_norm_of_a_channels_last_input": (_eval_batch_norm, [((2, 3, 5, 5), "cl"),
                                                                   ((3,), "row")]),
}
# right before the replay too, and slow to compile: `make test` runs the `.grad` test below
_SLOW_CASES = {
    "conv_of_channels_last_input_and_weight": (_conv, [((2, 3, 6, 6), "cl"),
                                                       ((4, 3, 3, 3), "cl")]),
}


def _inputs(spec, seed=0):
    generator = torch.Generator().manual_seed(seed)
    made = []
    for shape, layout in spec:
        if layout == "t":
            t = torch.randn(shape[::-1], generator=generator).t()
        elif layout == "cl":
            t = torch.randn(shape, generator=generator).contiguous(memory_format=CL)
        else:
            t = torch.randn(shape, generator=generator)
        made.append(t.requires_grad_())
    return made


def _grads(fn, inputs):
    out = fn(*inputs)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    return torch.autograd.grad(out, inputs, cotangent)


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("case", [*sorted(_CASES), *(
    pytest.param(name, marks=pytest.mark.slow) for name in _SLOW_CASES)])
def test_autograd_grad_returns_eagers_gradient_layouts(case, dynamic):
    fn, spec = {**_CASES, **_SLOW_CASES}[case]
    expected = _grads(fn, _inputs(spec))
    jitted = fulmen.jit(fn, dynamic=dynamic)
    for seed in (0, 2):  # the first backward decides, the second reuses it
        actual = _grads(jitted, _inputs(spec, seed))
        expected = _grads(fn, _inputs(spec, seed))
        for got, want in zip(actual, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert got.stride() == want.stride(), (case, got.stride(), want.stride())
            assert got.is_contiguous() == want.is_contiguous()
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_a_symbolic_entry_lays_out_the_gradients_of_other_sizes_as_eager():
    jitted = fulmen.jit(_mm, dynamic=True)
    for rows in (4, 6, 7):
        spec = [((rows, 5), "t"), ((5, 3), "row")]
        actual, expected = _grads(jitted, _inputs(spec)), _grads(_mm, _inputs(spec))
        assert [g.stride() for g in actual] == [g.stride() for g in expected]
        assert expected[0].stride() == (1, rows)  # transposed: not vacuous


def test_grad_attributes_of_channels_last_parameters_are_eagers():
    """`.grad` of channels-last input and weight through a conv (AccumulateGrad's contract)."""
    leaves = _inputs([((2, 3, 6, 6), "cl"), ((4, 3, 3, 3), "cl")])
    mine = [t.detach().clone(memory_format=CL).requires_grad_() for t in leaves]
    _conv(*leaves).square().sum().backward()
    fulmen.jit(_conv)(*mine).square().sum().backward()
    for got, want in zip(mine, leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)
        assert got.grad.stride() == want.grad.stride()
        assert got.grad.is_contiguous(memory_format=CL)


def _inference(*shape):
    with torch.inference_mode():
        return torch.randn(*shape)


def _scaled(x, w):
    return (x * w).sin()


def _exp_scaled(x, w):
    return x.exp() * w


@pytest.mark.parametrize("dynamic", [None, True])
def test_an_inference_tensor_eager_saves_for_backward_raises_eagers_error(dynamic):
    x, w = _inference(3), torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="cannot be saved for backward"):
        _scaled(x, w)
    jitted = fulmen.jit(_scaled, dynamic=dynamic)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cannot be saved for backward.*`x`"):
            jitted(x, w)
    # the same entry serves ordinary tensors, and inference mode
    torch.testing.assert_close(jitted(x.clone(), w), _scaled(x.clone(), w))
    with torch.inference_mode():
        out = jitted(x, w)
    assert out.is_inference() and not out.requires_grad


def test_an_inference_tensor_of_a_module_call_raises_as_eager():
    linear, x = torch.nn.Linear(3, 2), _inference(4, 3)
    with pytest.raises(RuntimeError, match="cannot be saved for backward"):
        linear(x)
    with pytest.raises(RuntimeError, match="cannot be saved for backward"):
        fulmen.jit(linear)(x)


def test_an_inference_tensor_eager_does_not_save_is_accepted():
    x, w = _inference(3), torch.randn(3, requires_grad=True)
    expected = _exp_scaled(x, w)
    actual = fulmen.jit(_exp_scaled)(x, w)
    torch.testing.assert_close(actual, expected)
    actual.sum().backward()
    torch.testing.assert_close(w.grad, x.exp())


@pytest.mark.parametrize("make,shape", [
    (lambda: torch.nn.BatchNorm2d(3).eval(), (2, 3, 4, 4)),
    (lambda: torch.nn.Conv3d(3, 2, 2), (1, 3, 3, 3, 3)),
], ids=["batch_norm_eval", "conv3d"])
def test_a_module_made_under_inference_mode_raises_eagers_error(make, shape):
    """An op run by torch.autograd inside the forward failed first with another message
    ("Setting requires_grad=True on inference tensor outside InferenceMode")."""
    with torch.inference_mode():
        module = make()
    x = torch.randn(shape)
    with pytest.raises(RuntimeError, match="cannot be saved for backward"):
        module(x)
    with pytest.raises(RuntimeError, match="cannot be saved for backward"):
        fulmen.jit(module)(x)


@pytest.mark.parametrize("case", ["mm_of_a_transposed_input", "mean_of_a_channels_last_input",
                                  "eval_batch_norm_of_a_channels_last_input"])
def test_fulmen_grad_returns_the_layouts_of_torch_func_grad(case):
    fn, spec = _CASES[case]
    argnums = tuple(range(len(spec)))

    def loss(*args):
        return fn(*args).square().sum()

    inputs = [t.detach() for t in _inputs(spec)]
    expected = torch.func.grad(loss, argnums)(*inputs)
    for _ in range(2):
        actual = fulmen.grad(loss, argnums)(*inputs)
        for got, want in zip(actual, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert got.stride() == want.stride(), (case, got.stride(), want.stride())


def test_fulmen_vjp_returns_the_layouts_of_torch_func_vjp():
    inputs = [t.detach() for t in _inputs(_CASES["mm_of_a_transposed_input"][1])]
    cotangent = torch.randn(4, 3)
    expected = torch.func.vjp(_mm, *inputs)[1](cotangent)
    actual = fulmen.vjp(_mm, *inputs)[1](cotangent)
    assert expected[0].stride() == (1, 4)  # transposed: not vacuous
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.stride() == want.stride()
