"""Traced tensors a forward stores on its modules (`self.aux_loss = loss`, a buffer replaced,
`self.kv = (k, v)`): every compiled call stores its own values, and gradients reach them
(`fulmen.tracer.module_stores`)."""

import copy
import warnings

import pytest
import torch

import fulmen
from fulmen.core import NotYetSupportedError


class _Expert(torch.nn.Module):
    """A switch-style MoE layer that leaves its load-balancing loss on itself."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(4, 2)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.aux_loss = None

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        self.aux_loss = (probs.mean(0) ** 2).sum() * 2
        return sum(p.unsqueeze(-1) * e(x) for p, e in zip(probs.unbind(-1), self.experts))


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Expert() for _ in range(2))
        self.register_buffer("memory", torch.zeros(0, 4))
        self.kv = None
        self.last = None

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        summary = x.detach().mean(0, keepdim=True)
        self.memory = torch.cat([self.memory, summary])[-3:]  # a buffer replaced, growing
        self.kv = (x[:1], x.shape[0], "kv")
        self.last = {"out": x.detach()}
        return x + self.memory.mean(0)


def _step(model, x):
    out = model(x)
    aux = sum(layer.aux_loss for layer in model.layers)
    loss = out.square().mean() + aux
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out.detach(), aux.detach(), model.memory.clone(), model.kv[0].detach(), model.kv[1:], \
        model.last["out"], grads


def test_tensor_stores_are_made_by_every_compiled_call_and_carry_gradients():
    torch.manual_seed(0)
    eager = _Net()
    compiled_model = copy.deepcopy(eager)
    jitted = fulmen.jit(compiled_model)
    for step in range(5):
        x = torch.randn(3 + step % 2, 4)
        want = _step(eager, x)
        got = _step(jitted, x)
        assert got[4] == want[4] == (x.shape[0], "kv")
        torch.testing.assert_close(got[:4] + got[5:], want[:4] + want[5:])
    assert fulmen.compile_stats(jitted).eager_calls == 0
    # the stored tensors are keyed by their metadata, not identity: once the buffer stops
    # growing, calls hit the cache
    for call in range(6):
        if call == 2:  # (the int stored in `kv` is the previous call's batch: keyed)
            compiles = fulmen.compile_stats(jitted).cache_misses
        torch.testing.assert_close(_step(jitted, x)[0], _step(eager, x)[0])
    assert fulmen.compile_stats(jitted).cache_misses == compiles



class _KeepsSizes(torch.nn.Module):
    def forward(self, x):
        self.rows = x.shape[0]
        self.kv = (x[:1], x.shape[0] * 2, "kv")
        return x * 2


def test_symbolic_sizes_stored_on_the_module_are_each_calls_own():
    # a stored symbolic size (the batch of a call past the first shape) was refused: every such
    # call ran eagerly (fullgraph=True raised)
    model, eager = _KeepsSizes(), _KeepsSizes()
    jitted = fulmen.jit(model, fullgraph=True)
    for rows in (3, 4, 5, 4):
        x = torch.randn(rows, 2)
        torch.testing.assert_close(jitted(x), eager(x))
        assert type(model.rows) is int and model.rows == eager.rows == rows
        assert model.kv[1:] == eager.kv[1:] and type(model.kv[1]) is int
        torch.testing.assert_close(model.kv[0], eager.kv[0])


_EAGER_LOG = []


class _ReplacesAndMayLog(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(1))
        self.log = False

    def forward(self, x):
        self.total = self.total + x.sum()
        if self.log:  # a store into a global list: the call runs eagerly
            _EAGER_LOG.append(1)
        return x * self.total


def test_eager_calls_stay_counted_when_the_module_is_compiled_anew():
    """An eager call that replaces a buffer changes the module's structure, so the next call
    compiles anew; `compile_stats` counted the eager calls of the new compilation only, so a
    test asserting no eager call passed after one."""
    model, eager = _ReplacesAndMayLog(), _ReplacesAndMayLog()
    jitted = fulmen.jit(model)
    for log in (False, True, False):
        model.log = eager.log = log
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(jitted(torch.ones(2)), eager(torch.ones(2)))
    assert len(_EAGER_LOG) == 2  # (the eager model's call and the eager run's)
    assert fulmen.compile_stats(jitted).eager_calls == 1

class _ReadsLater(torch.nn.Module):
    """Stores a tensor every call; reads it back only once `self.read` is set."""

    def __init__(self):
        super().__init__()
        self.read = False
        self.saved = None

    def forward(self, x):
        out = x + self.saved if self.read else x * 2
        self.saved = x * 3
        return out


def test_an_attribute_read_after_calls_that_only_wrote_it_is_the_stored_one():
    eager, model = _ReadsLater(), _ReadsLater()
    jitted = fulmen.jit(model)
    for step in range(6):
        eager.read = model.read = step >= 2
        x = torch.full((2,), float(step))
        torch.testing.assert_close(jitted(x), eager(x))
        torch.testing.assert_close(model.saved, eager.saved)


class _Recurrent(torch.nn.Module):
    """Reads the state it stored on the previous call."""

    def __init__(self):
        super().__init__()
        self.cell = torch.nn.Linear(4, 4)
        self.h = torch.zeros(4)

    def forward(self, x):
        self.h = torch.tanh(self.cell(x) + self.h)
        return self.h * 2


def test_a_state_read_back_on_the_next_call_is_the_stored_one():
    torch.manual_seed(0)
    eager = _Recurrent()
    jitted = fulmen.jit(copy.deepcopy(eager))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4)
            torch.testing.assert_close(jitted(x), eager(x))
            torch.testing.assert_close(jitted.h, eager.h)
    # `self.h` is read afresh on every call and keyed by its metadata: one compilation (it was
    # keyed by identity: a compilation per call, eager past the cache size limit)
    assert fulmen.compile_stats(jitted).cache_misses == 1
    jitted.h = torch.ones(4)  # replaced from outside: read as it is now
    eager.h = torch.ones(4)
    with torch.no_grad():
        torch.testing.assert_close(jitted(x), eager(x))


class _RecurrentWithBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = torch.nn.Linear(3, 3)
        self.acc = torch.zeros(3)

    def forward(self, x):
        y = self.cell(x)
        if y.sum() > -100:  # a graph break: the program keeps the tensors it captured
            y = y + self.acc
        self.acc = self.acc + 1
        return y


def test_a_state_stored_and_read_across_a_graph_break_is_the_stored_one():
    """A program with a graph break keeps the tensor it captured, so an attribute it read and
    also stores is keyed by identity (`note_module_writes`: read, never written): each call
    sees the value the previous call stored, as eager does."""
    torch.manual_seed(0)
    eager = _RecurrentWithBreak()
    jitted = fulmen.jit(copy.deepcopy(eager))
    x = torch.randn(2, 3)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(jitted(x), eager(x))
            torch.testing.assert_close(jitted.acc, eager.acc)
        jitted.acc = torch.full((3,), 10.0)  # replaced from outside
        eager.acc = torch.full((3,), 10.0)
        torch.testing.assert_close(jitted(x), eager(x))


class _StoresInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.maps = []

    def forward(self, x):
        self.maps.append(x * 2)
        return x + 1


def test_a_traced_tensor_put_into_a_module_list_runs_eagerly():
    model = _StoresInPlace()
    with pytest.raises(NotYetSupportedError, match="inside a list or dict in the module attribute 'maps'"):
        fulmen.jit(model, fullgraph=True)(torch.ones(2))
    assert model.maps == []
    with pytest.warns(UserWarning, match="'maps'"):
        torch.testing.assert_close(fulmen.jit(model)(torch.ones(2)), torch.full((2,), 2.0))
    assert len(model.maps) == 1 and torch.equal(model.maps[0], torch.full((2,), 2.0))


class _RunningRange(torch.nn.Module):
    """HF I-BERT's QuantAct in training: a running range from `x.data`, replaced each call, with
    a value-dependent check (a graph break) before the store."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("x_min", torch.zeros(1))

    def forward(self, x):
        y = self.linear(x)
        low = y.data.min()
        assert low.isnan().sum() == 0, "NaN"
        self.x_min = torch.min(self.x_min, low)
        return y * 2


def test_a_buffer_replaced_after_a_graph_break_from_detached_data_trains_as_eager():
    # was refused (a traced store with graph breaks); `y.data` carried grad into the store, so
    # the next backward went through the previous call's graph
    torch.manual_seed(0)
    eager = _RunningRange()
    jitted = fulmen.jit(copy.deepcopy(eager))
    for _ in range(4):
        x = torch.randn(3, 4)
        results = []
        for model in (eager, jitted):
            out = model(x)
            out.sum().backward()
            results.append((out, model.x_min.clone(), model.x_min.requires_grad,
                            model.linear.weight.grad.clone()))
            model.zero_grad()
        torch.testing.assert_close(results[1], results[0])


class _KeepsItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.last_input = None

    def forward(self, x):
        self.last_input = x
        return self.linear(x)


def test_an_argument_stored_on_the_module_is_the_argument_itself():
    # was an alias made by the compiled program: `is` failed, and for an input requiring grad
    # it was a non-leaf, so `model.last_input.grad` stayed None after backward
    model = _KeepsItsInput()
    jitted = fulmen.jit(model)
    for _ in range(2):
        x = torch.randn(2, 3, requires_grad=True)
        jitted(x).sum().backward()
        assert model.last_input is x and model.last_input.grad is not None


class _PrivateScale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._scale = torch.tensor(2.0)

    def forward(self, x):
        return x * self._scale


def test_a_private_tensor_attribute_replaced_between_calls_is_read_as_it_is_now():
    # private attributes were not keyed: the tensor captured by the first trace was reused
    model = _PrivateScale()
    jitted = fulmen.jit(model)
    x = torch.ones(2)
    for scale in (torch.tensor(2.0), torch.tensor([3.0, 4.0]), torch.tensor(5.0)):
        model._scale = scale
        torch.testing.assert_close(jitted(x), x * scale)


class _ResettingRope(torch.nn.Module):
    """HF's dynamic RoPE in small: a buffer replaced by a computed one when the input grows
    past the cached length, and by another buffer of the module itself (the original
    frequencies) when it shrinks back; `branch` decides by a shape (no graph break) or by a
    tensor's value (a graph break, as HF's `seq_len > max_seq_len_cached`)."""

    def __init__(self, branch):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)
        self.original_inv_freq = torch.nn.Buffer(torch.ones(4), persistent=False)
        self.cached = 8
        self.branch = branch

    def forward(self, x):
        length = x.max() + 1
        grows, shrinks = (x.shape[0] > self.cached, x.shape[0] < 8 < self.cached)
        if self.branch == "value":
            grows = bool(length > self.cached)
            shrinks = bool(length < 8 and self.cached > 8)
        if grows:
            self.register_buffer("inv_freq", torch.full((4,), 2.0), persistent=False)
            self.cached = x.shape[0]
        if shrinks:
            original = self.original_inv_freq.to(x.device)  # the very tensor
            self.register_buffer("inv_freq", original, persistent=False)
            self.original_inv_freq = original
            self.cached = 8
        return x[:4] * self.inv_freq


@pytest.mark.parametrize("branch", ["shape", "value"])
def test_a_buffer_replaced_by_another_buffer_of_the_module_is_that_buffer(branch):
    eager = _ResettingRope(branch)
    jitted = fulmen.jit(copy.deepcopy(eager))
    module = jitted._orig_mod
    for length in (6, 12, 5, 12, 5, 6):
        x = torch.arange(length, dtype=torch.float32)
        torch.testing.assert_close(jitted(x), eager(x), rtol=0, atol=0)
        torch.testing.assert_close(module.inv_freq, eager.inv_freq, rtol=0, atol=0)
        assert (module.inv_freq is module.original_inv_freq) == (
            eager.inv_freq is eager.original_inv_freq)


def test_a_buffer_swapped_for_another_buffer_without_any_op_is_stored():
    class Swap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Buffer(torch.full((3,), 2.0))
            self.b = torch.nn.Buffer(torch.ones(3))

        def forward(self, x):
            self.a, self.b = self.b, self.a
            return x * self.a

    eager = Swap()
    jitted = fulmen.jit(copy.deepcopy(eager))
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), eager(x), rtol=0, atol=0)
        torch.testing.assert_close(jitted.a, eager.a, rtol=0, atol=0)
        torch.testing.assert_close(jitted.b, eager.b, rtol=0, atol=0)
