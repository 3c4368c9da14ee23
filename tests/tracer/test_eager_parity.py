"""Divergences from eager PyTorch in requires_grad, aliasing and autograd behaviour, each found
by a probe and fixed: the compiled call must answer as eager does."""

import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fulmen


def _view_under_no_grad(x):
    with torch.no_grad():
        v = x[1:].t()
    return v


def _view_under_no_grad_then_grad(x):
    with torch.no_grad():
        v = x[1:]
    return v.t()


@pytest.mark.parametrize("fn", [_view_under_no_grad, _view_under_no_grad_then_grad])
def test_view_of_an_input_taken_under_no_grad_answers_as_eager(fn):
    x = torch.randn(4, 3, requires_grad=True)
    expected, actual = fn(x), fulmen.jit(fn)(x)
    assert torch.equal(actual, expected)
    assert actual.requires_grad == expected.requires_grad
    assert actual._base is x and expected._base is x
    assert type(actual.grad_fn) is type(expected.grad_fn)
    assert actual.is_leaf == expected.is_leaf


def test_in_place_on_a_view_taken_under_no_grad_raises_as_eager():
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="created in no_grad mode"):
        _view_under_no_grad(x).add_(1)
    with pytest.raises(RuntimeError, match="created in no_grad mode"):
        fulmen.jit(_view_under_no_grad)(x).add_(1)


def _total(y):
    return y.sum()


def test_input_updated_in_place_after_a_dynamic_sum_still_backpropagates():
    # sum's backward needs only y's sizes: eager saves no tensor, so a later in-place update
    # of y is fine; the symbolic sizes must not keep y itself saved
    jf = fulmen.jit(_total, dynamic=True)
    for rows in (5, 7):
        x = torch.randn(rows, 3, requires_grad=True)
        y = x * 1
        total = jf(y)
        y.mul_(3)
        total.backward()
        assert torch.equal(x.grad, torch.ones(rows, 3))


n = 3  # a global that shares its name with `ctx.n` below
SCALE = 2.0


class _TimesFive(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.n = 5
        return x * 5

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.n


def _times_five_scaled(x):
    return _TimesFive.apply(x) * SCALE


def test_a_ctx_attribute_named_like_a_global_does_not_key_the_cache():
    global n, SCALE
    jf = fulmen.jit(_times_five_scaled)
    x = torch.randn(3, requires_grad=True)
    try:
        for value in (10, 11, 12):
            n = value  # `ctx.n` reads no global: no retrace
            jf(x)
        assert fulmen.compile_stats(jf).cache_misses == 1
        SCALE = 4.0  # a global the program reads: retraced, with its new value
        assert torch.equal(jf(x), x.detach() * 20)
        assert fulmen.compile_stats(jf).cache_misses == 2
    finally:
        n, SCALE = 3, 2.0


class _RunningMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("avg", torch.zeros(3))

    def forward(self, x):
        y = self.lin(x)
        self.avg.mul_(0.9).add_(y.mean(0))
        return y.sum() + self.avg.sum()


def test_buffer_updated_in_place_with_a_value_requiring_grad_answers_as_eager():
    torch.manual_seed(0)
    eager, compiled = _RunningMean(), _RunningMean()
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(4, 3)
    expected = eager(x)
    with pytest.warns(UserWarning, match=r"add_.*avg.*requires grad"):
        actual = fulmen.jit(compiled)(x)
    torch.testing.assert_close(actual, expected)
    assert compiled.avg.requires_grad and compiled.avg.grad_fn is not None  # as eager's buffer
    torch.testing.assert_close(compiled.avg, eager.avg)
    expected.backward()
    actual.backward()
    torch.testing.assert_close(compiled.lin.weight.grad, eager.lin.weight.grad)


def test_buffer_updated_with_a_value_requiring_grad_under_fullgraph_names_op_buffer_and_line():
    with pytest.raises(fulmen.core.RunsEagerly, match=r"(?s)add_.*avg.*self\.avg\.mul_\(0\.9\)"):
        fulmen.jit(_RunningMean(), fullgraph=True)(torch.randn(4, 3))



def _computed_from_a_view_made_under_no_grad(x):
    with torch.no_grad():
        v = x[1:]
    return v * 2, v.requires_grad


def _view_of_a_view_made_under_no_grad(x):
    with torch.no_grad():
        v = x[1:]
        w = v.reshape(-1)
    return w.t() if w.dim() > 1 else w[1:]


def _same_tensor_answers(actual, expected):
    assert torch.equal(actual, expected)
    assert (actual.requires_grad, actual.is_leaf, actual.grad_fn is None, actual._is_view()) == (
        expected.requires_grad, expected.is_leaf, expected.grad_fn is None, expected._is_view())


def test_a_result_computed_from_a_view_made_under_no_grad_requires_grad_as_in_eager():
    # eager's view of a tensor requiring grad made under no_grad is a new leaf that requires
    # grad (NOTE [a view made under no_grad]): so is what is computed from it afterwards (the
    # compiled call runs eagerly, as for any result of a leaf made inside the function)
    x = torch.randn(4, 3, requires_grad=True)
    expected = _computed_from_a_view_made_under_no_grad(x)
    with pytest.warns(UserWarning, match="torch.no_grad"):
        actual = fulmen.jit(_computed_from_a_view_made_under_no_grad)(x)
    _same_tensor_answers(actual[0], expected[0])
    assert actual[1] is expected[1] is True


def test_a_view_of_a_view_made_under_no_grad_is_returned_compiled_as_eager_returns_it():
    x = torch.randn(4, 3, requires_grad=True)
    jf = fulmen.jit(_view_of_a_view_made_under_no_grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback
        actual = jf(x)
    _same_tensor_answers(actual, _view_of_a_view_made_under_no_grad(x))
    assert actual._base is x
    assert fulmen.compile_stats(jf).cache_misses == 1


class _CopiesItsWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("flat", torch.zeros(16))

    def forward(self, x):
        with torch.no_grad():
            self.flat.copy_(self.lin.weight.view(-1))  # a view made under no_grad, written
        return self.lin(x).sum() + self.flat.sum()


def test_a_view_made_under_no_grad_written_into_a_buffer_stays_compiled():
    eager, compiled = _CopiesItsWeight(), _CopiesItsWeight()
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback
        actual = fulmen.jit(compiled)(x)
    expected = eager(x)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(compiled.flat, eager.flat)
    actual.backward()
    expected.backward()
    torch.testing.assert_close(compiled.lin.weight.grad, eager.lin.weight.grad)


def _doubled_under_inference_mode(x):
    with torch.inference_mode():
        y = x * 2
    return y, y[1:]


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_tensor_made_under_inference_mode_is_returned_as_an_inference_tensor(requires_grad):
    # NOTE [inference tensors made inside]: updating it in place outside inference mode
    # raises in eager, and must not silently work
    x = torch.randn(3, requires_grad=requires_grad)
    expected = _doubled_under_inference_mode(x)
    with pytest.warns(UserWarning, match="inference_mode"):
        actual = fulmen.jit(_doubled_under_inference_mode)(x)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
        assert a.is_inference() and e.is_inference()
    with pytest.raises(RuntimeError, match="[Ii]nference tensor"):
        actual[0].add_(1)


def _view_taken_under_inference_mode(x):
    with torch.inference_mode():
        v = x[1:]  # a view of an ordinary tensor: ordinary
    return v, v * 3


def test_a_view_of_an_ordinary_tensor_taken_under_inference_mode_stays_compiled():
    x = torch.randn(3)
    jf = fulmen.jit(_view_taken_under_inference_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        actual = jf(x)
    expected = _view_taken_under_inference_mode(x)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
        assert a.is_inference() is e.is_inference() is False



def _reshaped_by_a_size(x, size):
    return x.reshape(size.numel()) if isinstance(size, torch.Size) else x * 0


def test_a_torch_size_argument_and_result_stay_torch_sizes():
    # PyTorch's pytree rebuilds a torch.Size node as a plain tuple
    x = torch.randn(2, 3)
    assert torch.equal(fulmen.jit(_reshaped_by_a_size)(x, x.shape), _reshaped_by_a_size(x, x.shape))
    out = fulmen.jit(lambda x: (x * 2, {"shape": x.shape}))(x)
    assert type(out[1]["shape"]) is torch.Size and out[1]["shape"] == x.shape


def _size_returned_after_a_break(x):
    if x.sum() > 0:  # a graph break: the trace tree assembles the output
        return x * 2, x.shape[0], {"shape": x.shape}
    return x, 0, {"shape": x.size()[1:]}


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_symbolic_size_returned_after_a_graph_break_is_this_calls_size(dynamic):
    jf = fulmen.jit(_size_returned_after_a_break, dynamic=dynamic)
    for rows in (2, 3, 4, 5):
        x = torch.randn(rows, 3).abs()
        for arg in (x, -x):
            actual, expected = jf(arg), _size_returned_after_a_break(arg)
            assert actual[1] == expected[1]
            assert type(actual[2]["shape"]) is torch.Size
            assert actual[2]["shape"] == expected[2]["shape"]


class _BranchesOnTheGraph(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        return h * (2.0 if h.is_leaf else 3.0)


def test_is_leaf_and_grad_fn_of_traced_tensors_answer_as_eager():
    """NOTE [graph reads]: a proxy answered `is_leaf` True for a value computed from
    parameters requiring grad (eager: False), so the compiled branch differed; `grad_fn`, which
    no trace can give, runs the call eagerly, as the graph walk of `FlopCounterMode`'s module
    tracker (it crashed on the None)."""
    model = _BranchesOnTheGraph()
    jmodel, x = fulmen.jit(model), torch.randn(2, 4)
    for grad in (True, False, True):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(jmodel(x), model(x))
    assert fulmen.compile_stats(jmodel).cache_misses == 2

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    counted, flops = fulmen.jit(net), []
    counted(x)
    for run in (net, counted):
        with warnings.catch_warnings(record=True), \
                FlopCounterMode(display=False) as counter:
            run(x).sum().backward()
        flops.append(counter.get_total_flops())
    assert flops[1] == flops[0] > 0


def test_is_leaf_of_an_argument_requiring_grad_runs_the_call_eagerly():
    """Whether the caller's tensor is a leaf is not in the key: reading it runs eagerly."""
    def fn(x):
        return x * (2.0 if x.is_leaf else 3.0)

    jfn = fulmen.jit(fn)
    leaf = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings(record=True):
        for x in (leaf, leaf * 1, leaf):
            torch.testing.assert_close(jfn(x), fn(x))
    with pytest.raises(fulmen.FulmenError, match="is_leaf"):
        fulmen.jit(fn, fullgraph=True)(leaf)


def _draws(x, gen):
    return (x + torch.randn(x.shape, generator=gen) + torch.bernoulli(x.sigmoid(), generator=gen)
            + torch.empty_like(x).uniform_(generator=gen) + x[torch.randperm(4, generator=gen)])


def test_random_ops_given_a_generator_draw_from_it_as_in_eager():
    """Random ops given an explicit `generator=` draw from it, not from the global generator,
    on each call with a fresh generator; both generators end in eager's states."""
    jitted = fulmen.jit(_draws)
    for call in range(3):
        runs = []
        for fn in (_draws, jitted):
            gen = torch.Generator().manual_seed(call)
            torch.manual_seed(10)
            out = fn(torch.linspace(-1, 1, 4), gen)
            runs.append((out, gen.get_state(), torch.get_rng_state()))
        torch.testing.assert_close(runs[1], runs[0])


def test_weights_updated_between_forward_and_backward_raise_as_in_eager():
    """An optimizer-like in-place update of a saved weight between a (second) forward and its
    backward raises eager's version-counter error instead of differentiating with the new
    weight."""
    for jit in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        call = fulmen.jit(model) if jit else model
        call(torch.randn(2, 3)).sum().backward()
        out = call(torch.randn(2, 3))
        with torch.no_grad():
            model[2].weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
