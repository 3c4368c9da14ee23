"""Module machinery and Python-level torch APIs real model code uses inside `forward`."""

import contextlib
import copy
import dataclasses
import typing
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import fulmen
from fulmen import NotYetSupportedError


def _twin(make):
    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    return eager, make()


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 3)})
        self.register_buffer("scale", torch.full((4,), 0.5))
        self.register_buffer("shift", torch.ones(4), persistent=False)

    def forward(self, x, head: str = "a"):
        for layer in self.layers[:2]:
            x = torch.relu(layer(x))
        x = self.layers[-1](x) * self.scale + self.shift
        return self.heads[head](x)


def test_module_list_dict_and_buffers():
    eager, jitted = _twin(Stack)
    jmodel = fulmen.jit(jitted)
    x = torch.randn(2, 4)
    for head in ("a", "b", "a"):
        torch.testing.assert_close(jmodel(x, head), eager(x, head))
    assert "shift" not in jitted.state_dict() and "scale" in jitted.state_dict()
    trace = str(fulmen.last_traces(jmodel)[0])
    assert "layers_0_weight" in trace and "heads_b_weight" in trace and "shift" in trace
    # buffers are inputs, not constants: a new value is used without retracing
    for module in (eager, jitted):
        module.shift.fill_(-2.0)
        module.scale = torch.full((4,), 3.0)  # a new tensor object in the buffer slot
    torch.testing.assert_close(jmodel(x, "a"), eager(x, "a"))


def _hooked_twins(pre_hook, post_hook):
    """An eager Linear and its jitted twin, each with the two forward hooks."""
    eager, jitted = _twin(lambda: nn.Linear(3, 3))
    for module in (eager, jitted):
        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook)
    return eager, fulmen.jit(jitted)


def test_forward_pre_and_post_hooks_are_compiled():
    """Hooks that change the input and output are traced through (no call runs eagerly)."""
    eager, jmodel = _hooked_twins(lambda module, args: (args[0] * 2,),
                                  lambda module, args, output: output + 1)
    x = torch.randn(2, 3)
    for _ in range(2):
        torch.testing.assert_close(jmodel(x), eager(x))
    assert fulmen.compile_stats(jmodel).eager_calls == 0 and fulmen.cache_hits(jmodel) == 1


def test_forward_pre_and_post_hooks_run():
    """Hooks that append to a list they close over: the call runs eagerly (a compiled call
    would not repeat the store), so they run on every call, as in eager."""
    calls = []

    def pre_hook(module, args):
        calls.append("pre")
        return (args[0] * 2,)

    def post_hook(module, args, output):
        calls.append("post")
        return output + 1

    eager, jmodel = _hooked_twins(pre_hook, post_hook)
    x = torch.randn(2, 3)
    torch.testing.assert_close(jmodel(x), eager(x))
    torch.testing.assert_close(jmodel(x), eager(x))
    assert calls.count("pre") == calls.count("post") >= 4  # every call, compiled or eager


def _no_grad_blocks(x, w):
    with torch.no_grad():
        frozen = x * w
        with torch.enable_grad():
            inner = x * w
    live = x * w + frozen
    return frozen, inner, live


def test_no_grad_and_enable_grad_blocks():
    x = torch.randn(3)
    w = torch.randn(3, requires_grad=True)
    expected = _no_grad_blocks(x, w)
    actual = fulmen.jit(_no_grad_blocks)(x, w)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    g_expected = torch.autograd.grad(expected[1].sum() + expected[2].sum(), w)
    g_actual = torch.autograd.grad(actual[1].sum() + actual[2].sum(), w)
    torch.testing.assert_close(g_actual, g_expected)  # nothing flows through `frozen`


def test_no_grad_results_do_not_require_grad():
    w = torch.randn(3, requires_grad=True)
    frozen, _, _ = fulmen.jit(_no_grad_blocks)(torch.randn(3), w)
    assert not frozen.requires_grad


def test_enable_grad_inside_a_no_grad_call_runs_eagerly_or_raises_under_fullgraph():
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3)
    with torch.no_grad():
        with pytest.raises(NotYetSupportedError, match="enable_grad"):
            fulmen.jit(_no_grad_blocks, fullgraph=True)(x, w)
        with pytest.warns(UserWarning, match="enable_grad"):
            got = fulmen.jit(_no_grad_blocks)(x, w)
        want = _no_grad_blocks(x, w)
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b)
            assert a.requires_grad == b.requires_grad


def _autocast_fn(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        enabled = torch.is_autocast_enabled("cpu")
        y = x @ w
        z = F.linear(y.float(), w) + 1
        s = torch.cat([z, x])
        with torch.autocast("cpu", enabled=False):
            plain = x @ w
    return y, z, s, plain, enabled


def test_autocast_regions_give_eager_dtypes():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    expected = _autocast_fn(x, w)
    jfn = fulmen.jit(_autocast_fn)
    actual = jfn(x, w)
    assert actual[-1] is True
    for a, e in zip(actual[:-1], expected[:-1]):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e)
    assert "torch.bfloat16" in str(fulmen.last_traces(jfn)[0])  # the casts are in the trace


def test_autocast_around_the_call():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    fn = lambda x, w: (x @ w).relu()  # noqa: E731
    jfn = fulmen.jit(fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = fn(x, w), jfn(x, w)
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected)
    assert jfn(x, w).dtype == torch.float32  # the autocast state is part of the cache key


def test_python_level_torch_queries():
    def fn(x, i):
        assert isinstance(x, torch.Tensor) and torch.is_tensor(x)
        assert not torch.jit.is_scripting() and not torch.jit.is_tracing()
        scale = 2.0 if torch.compiler.is_compiling() else 3.0
        low = torch.finfo(x.dtype).min
        high = torch.iinfo(i.dtype).max
        return x.clamp(min=low) * scale, i.clamp(max=high) + torch.finfo(torch.float16).eps

    x, i = torch.randn(3), torch.arange(3, dtype=torch.int32)
    expected, actual = fn(x, i), fulmen.jit(fn)(x, i)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    aux: torch.Tensor | None = None


class Pair(typing.NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


def test_dataclass_and_namedtuple_outputs():
    out = fulmen.jit(lambda x: Output(x + 1))(torch.ones(2))
    assert isinstance(out, Output) and out.aux is None
    torch.testing.assert_close(out.logits, torch.full((2,), 2.0))
    pair = fulmen.jit(lambda x: Pair(x * 2, x - 1))(torch.ones(2))
    assert isinstance(pair, Pair)
    torch.testing.assert_close(pair.first, torch.full((2,), 2.0))


def test_transformers_model_output():
    outputs = pytest.importorskip("transformers.modeling_outputs")

    def fn(x):
        return outputs.BaseModelOutput(last_hidden_state=x * 2, hidden_states=(x, x + 1))

    out = fulmen.jit(fn)(torch.ones(2))
    assert isinstance(out, outputs.BaseModelOutput)
    torch.testing.assert_close(out.last_hidden_state, torch.full((2,), 2.0))
    torch.testing.assert_close(out["hidden_states"][1], torch.full((2,), 2.0))
    assert out.attentions is None


class _StoresTensor(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.register_buffer("mem", torch.zeros(2))
        self.attr = torch.zeros(2)
        self.cache = {"h": torch.zeros(2)}

    def forward(self, x):
        if self.kind == "buffer":
            self.mem = self.mem + x
        elif self.kind == "attr":
            self.attr = self.attr + x
        else:
            self.cache["h"] = self.cache["h"] + x
        self.mem = self.mem.to(torch.float32)  # a no-op store of the module's own tensor is fine
        return x * 2


@pytest.mark.parametrize("kind", ["buffer", "attr"])
def test_a_traced_tensor_stored_on_the_module_is_stored_by_every_call(kind):
    # was silently dropped (the store happened only while tracing), then refused
    model, eager = _StoresTensor(kind), _StoresTensor(kind)
    jitted = fulmen.jit(model)
    for step in range(3):
        x = torch.full((2,), float(step + 1))
        torch.testing.assert_close(jitted(x), eager(x))
        torch.testing.assert_close((model.mem, model.attr), (eager.mem, eager.attr))


def test_a_traced_tensor_put_into_a_module_dict_runs_eagerly_and_is_undone_under_fullgraph():
    model = _StoresTensor("dict")
    before = (model.mem, model.attr, model.cache["h"])
    with pytest.raises(NotYetSupportedError, match="inside a list or dict in the module"):
        fulmen.jit(model, fullgraph=True)(torch.ones(2))
    assert (model.mem, model.attr, model.cache["h"]) == before  # the module is as it was
    eager = _StoresTensor("dict")
    jitted = fulmen.jit(model)
    with pytest.warns(UserWarning, match="inside a list or dict in the module"):
        for step in range(2):
            x = torch.full((2,), float(step + 1))
            torch.testing.assert_close(jitted(x), eager(x))
            torch.testing.assert_close(model.cache["h"], eager.cache["h"])


class _Tied(nn.Module):
    """Two layers sharing a weight, and one buffer registered under two names."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 3)
        self.second.weight = self.first.weight
        shared = torch.zeros(3)
        self.register_buffer("count", shared)
        self.second.register_buffer("seen", shared)

    def forward(self, x):
        self.count.add_(1)
        return (self.second(self.first(x).relu()) * self.second.seen).sum()


def test_tied_weights_are_one_input_with_eagers_gradient():
    """A weight shared by two layers (`lm_head.weight = embed.weight`) is one input of the
    trace: its gradient sums both uses as eager's, and a buffer registered under two names
    and updated through one is read updated through the other, with no eager fallback."""
    eager = _Tied()
    compiled = copy.deepcopy(eager)
    assert compiled.second.weight is compiled.first.weight
    jmodel = fulmen.jit(compiled)
    for _ in range(2):
        x = torch.randn(2, 3)
        expected, actual = eager(x), jmodel(x)
        torch.testing.assert_close(actual, expected)
        expected.backward()
        actual.backward()
        torch.testing.assert_close(compiled.first.weight.grad, eager.first.weight.grad)
        torch.testing.assert_close(compiled.count, eager.count)
    assert fulmen.compile_stats(jmodel).eager_calls == 0
def _lazy_net():
    return nn.Sequential(nn.LazyConv2d(4, 3), nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(),
                         nn.LazyLinear(2))


def test_lazy_modules_run_their_first_call_eagerly_then_compile():
    # a lazy module's parameters have no sizes until its first call materialises them: keying
    # the call or capturing them crashed; the first call runs eagerly, the next ones compile
    eager, net = _twin(_lazy_net)
    jnet = fulmen.jit(net)
    for step in range(3):
        x = torch.randn(2, 3, 6, 6)
        torch.manual_seed(step)
        expected = eager(x)
        torch.manual_seed(step)
        with pytest.warns(UserWarning, match="lazy module") if step == 0 else _no_warning():
            got = jnet(x)
        torch.testing.assert_close(got, expected)
        got.square().sum().backward()
        expected.square().sum().backward()
    for (name, p), q in zip(net.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    torch.testing.assert_close(net[1].running_var, eager[1].running_var)
    stats = fulmen.compile_stats(jnet)
    assert (stats.eager_calls, stats.cache_misses, stats.cache_hits) == (1, 1, 1)
    lazy = nn.LazyLinear(3)
    jfn = fulmen.jit(lambda x: lazy(x) * 2)  # a lazy module the function closes over
    for _ in range(3):
        x = torch.randn(2, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = jfn(x)
        torch.testing.assert_close(got, lazy(x) * 2)
    stats = fulmen.compile_stats(jfn)
    assert (stats.eager_calls, stats.cache_hits) == (1, 1)  # compiled once materialised


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield
