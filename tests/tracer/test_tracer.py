"""Tracing functions and modules: inputs, outputs, captures, errors."""

import pytest
import torch

import fulmen
from fulmen import FulmenError, NotYetSupportedError


def test_nested_inputs_kwargs_and_outputs():
    def fn(batch, scale=1.0, *, extra=None):
        a, (b, c) = batch["a"], batch["pair"]
        out = {"sum": a + b * scale, "list": [c - 1, b]}
        if extra is not None:
            out["extra"] = extra * 2
        return out

    jfn = fulmen.jit(fn)
    batch = {"a": torch.randn(3), "pair": (torch.randn(3), torch.randn(2))}
    for kwargs in ({}, {"scale": 2.0}, {"extra": torch.ones(1)}):
        expected, actual = fn(batch, **kwargs), jfn(batch, **kwargs)
        assert actual.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key])
    assert "batch_pair_0" in str(fulmen.last_traces(jfn)[0])


def test_named_tuple_outputs_are_rebuilt():
    from collections import namedtuple

    Pair = namedtuple("Pair", "first second")
    jfn = fulmen.jit(lambda x: Pair(x + 1, x * 2))
    out = jfn(torch.ones(2))
    assert isinstance(out, Pair)
    torch.testing.assert_close(out.second, torch.full((2,), 2.0))


def test_captured_tensor_mutated_between_calls_is_followed():
    bias = torch.zeros(3)

    def fn(x):
        return x + bias

    jfn = fulmen.jit(fn)
    x = torch.ones(3)
    torch.testing.assert_close(jfn(x), x)
    bias.fill_(5)
    torch.testing.assert_close(jfn(x), x + 5)
    assert "captured0" in str(fulmen.last_traces(jfn)[0])


def test_identity_returns_the_input_like_eager():
    jfn = fulmen.jit(lambda x: x)
    x = torch.ones(2)
    assert jfn(x) is x


def _item_user(x):
    if x.sum() > 0:  # value-dependent control flow
        return x
    return -x


@pytest.mark.parametrize(
    "fn, construct",
    [
        (_item_user, "bool(tensor)"),
        (lambda x: x * x.max().item(), "Tensor.item()"),
        (lambda x: torch.tensor(x.tolist()), "Tensor.tolist()"),
        (lambda x: x.numpy(), "Tensor.numpy()"),
    ],
)
def test_value_dependent_constructs_raise_with_source_line(fn, construct):
    # with fullgraph=True; by default these are graph breaks (tests/tracer/test_graph_breaks.py)
    with pytest.raises(FulmenError) as info:
        fulmen.jit(fn, fullgraph=True)(torch.randn(3))
    message = str(info.value)
    assert construct in message
    assert "test_tracer.py:" in message


def test_unsupported_inplace_ops_raise_instead_of_dropping_the_mutation():
    # in-place ops are functionalized (tests/tracer/test_inplace.py); those that change a
    # tensor's metadata in ways that are not views (or of an argument) still raise, naming the
    # op and the line
    def fn(x):
        y = x * 2
        y.resize_(3, 2)
        return y

    with pytest.raises(NotYetSupportedError) as info:
        fulmen.jit(fn, fullgraph=True)(torch.ones(2, 3))
    assert "resize_" in str(info.value) and "test_tracer.py:" in str(info.value)
    with pytest.warns(UserWarning, match="resize_"):  # without fullgraph: the call runs eagerly
        torch.testing.assert_close(fulmen.jit(fn)(torch.ones(2, 3)), fn(torch.ones(2, 3)))


def test_opaque_op_is_traced_and_run_by_torch():
    def fn(x):
        return torch.cumsum(x, dim=0).flip(0) + torch.special.i0(x)

    jfn = fulmen.jit(fn)
    x = torch.randn(5)
    torch.testing.assert_close(jfn(x), fn(x))
    execution = str(fulmen.last_traces(jfn)[-1])
    assert "torch.cumsum(x, dim=0)" in execution and "torch.special.i0(x)" in execution


def test_data_dependent_shape_raises_clearly():
    with pytest.raises(FulmenError, match="nonzero"):
        fulmen.jit(lambda x: torch.nonzero(x), fullgraph=True)(torch.randn(4))


def test_metadata_queries_are_constants():
    def fn(x):
        n, d = x.shape
        assert isinstance(x, torch.Tensor) and torch.is_tensor(x)
        return x * (d + x.size(0) + x.dim() + x.numel() + len(x)) if x.is_floating_point() else x

    jfn = fulmen.jit(fn)
    x = torch.randn(2, 3)
    torch.testing.assert_close(jfn(x), fn(x))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.register_buffer("offset", torch.arange(4.0))
        self.head = torch.nn.Linear(4, 4, bias=False)
        self.tied = self.head  # the same module twice

    def forward(self, x, *, scale=1.0):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.tied(x + self.offset) * scale


def test_module_parameters_are_shared_and_named():
    model = Block()
    jmodel = fulmen.jit(model)
    assert isinstance(jmodel, torch.nn.Module)
    assert [id(p) for p in jmodel.parameters()] == [id(p) for p in model.parameters()]
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(jmodel(x, scale=2.0), model(x, scale=2.0))
        for p in model.parameters():  # an optimizer-style in-place update between calls
            p.add_(0.1)
        torch.testing.assert_close(jmodel(x, scale=2.0), model(x, scale=2.0))
    assert fulmen.cache_misses(jmodel) == 1
    source = str(fulmen.last_traces(jmodel)[0])
    assert "layers_0_weight" in source and "offset" in source


def test_forward_hooks_run():
    model = torch.nn.Linear(3, 3)
    model.register_forward_hook(lambda module, args, out: out * 10)
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 3)
    with torch.no_grad():
        torch.testing.assert_close(jmodel(x), model(x))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.nn.functional.elu(x, inplace=True) * 0,
        lambda x: torch.nn.functional.relu(x, True) * 0,
        lambda x: torch.nn.functional.embedding(torch.tensor([0]), x, max_norm=1.0).sum() + x.sum(),
    ],
    ids=["elu-inplace-kwarg", "relu-inplace-positional", "embedding-max_norm"],
)
def test_mutating_arguments_are_detected(fn):
    # detected: either functionalized (the argument is updated as in eager) or raising
    x = torch.randn(3, 2)
    before, expected_x = x.clone(), x.clone()
    expected = fn(expected_x)
    try:
        actual = fulmen.jit(fn)(x)
    except FulmenError:
        assert torch.equal(x, before)  # raised before anything ran
        return
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(x, expected_x)


def test_ops_on_captured_tensors_are_traced_not_baked():
    table = torch.arange(6.0)

    def fn(x):
        return x + table.reshape(2, 3) * 2

    jfn = fulmen.jit(fn)
    x = torch.zeros(2, 3)
    torch.testing.assert_close(jfn(x), fn(x))
    table.add_(1)
    torch.testing.assert_close(jfn(x), fn(x))


def test_unused_random_ops_still_advance_the_generator():
    def fn(x):
        torch.nn.functional.dropout(x, 0.5, training=True)  # result unused
        torch.rand(3)  # result unused
        return x + torch.rand(2)

    jfn = fulmen.jit(fn)
    x = torch.zeros(2)
    jfn(x)
    torch.manual_seed(3)
    expected = fn(x)
    torch.manual_seed(3)
    torch.testing.assert_close(jfn(x), expected)


def test_unsupported_construct_errors_carry_the_examine_report():
    def fn(x):
        y = torch.special.i0(x)
        if y.sum() > 0:
            return y
        return -y

    with pytest.raises(FulmenError) as info:
        fulmen.jit(fn, fullgraph=True)(torch.randn(3))
    message = str(info.value)
    assert "bool(tensor)" in message and "fulmen.examine" in message
    assert "torch.special.i0" in message  # the report lists what traced before the failure
