"""User patterns probed in session 51 (h51probe3): attention variants, TorchScript and
torch.compile interplay, quantization-like forwards; each compared with eager PyTorch."""

import pytest
import torch
from torch import nn

import fulmen


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _WithScripted(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.sub = make(_Block())
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.sub(x) + x)


_SCRIPTERS = {"script": torch.jit.script,
              "trace": lambda block: torch.jit.trace(block, torch.randn(2, 8))}


@pytest.mark.parametrize("make", _SCRIPTERS.values(), ids=_SCRIPTERS)
@pytest.mark.parametrize("dynamic", [None, True])
def test_a_torchscript_submodule_inside_a_jitted_module(make, dynamic):
    """A `torch.jit.script`-ed (or traced) submodule: the class's `forward` is a descriptor
    that raises when read from the class, and its parameter tables are C++ views without
    `clear`; jitting the module raised AttributeError on its first call. Values and
    gradients equal eager's, and an update to the scripted weights is seen."""
    torch.manual_seed(0)
    model = _WithScripted(make)
    jitted = fulmen.jit(model, dynamic=dynamic) if dynamic else fulmen.jit(model)
    for rows in (4, 5):
        x = torch.randn(rows, 8, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        actual, expected = jitted(x), model(x_eager)
        torch.testing.assert_close(actual, expected)
        actual.sum().backward()
        got = model.sub.lin.weight.grad.clone()
        model.zero_grad()
        expected.sum().backward()
        torch.testing.assert_close(got, model.sub.lin.weight.grad)
        torch.testing.assert_close(x.grad, x_eager.grad)
        model.zero_grad()
    with torch.no_grad():
        model.sub.lin.weight.mul_(2)
    x = torch.randn(4, 8)
    torch.testing.assert_close(jitted(x), model(x))
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_a_jitted_scripted_module():
    """`fulmen.jit(torch.jit.script(module))` itself: values equal eager's."""
    scripted = torch.jit.script(_Block())
    jitted = fulmen.jit(scripted)
    x = torch.randn(4, 8)
    torch.testing.assert_close(jitted(x), scripted(x))


_sin_twice = fulmen.jit(lambda t: t.sin() * 2)


class _CallsJitted(nn.Module):
    def forward(self, x):
        return _sin_twice(x) + 1


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_of_a_module_calling_a_jitted_function(strict):
    """`torch.export` of a model whose forward calls a jitted function: the export traces the
    function's torch calls. The jitted call took export's tracing for `torch.compile`'s and
    recursed (RecursionError, non-strict) or hit its `torch.compiler.disable`d graph break
    (strict export: Unsupported)."""
    x = torch.randn(4, 8)
    model = _CallsJitted()
    program = torch.export.export(model, (x,), strict=strict)
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert torch.ops.aten.sin.default in targets
    torch.testing.assert_close(program.module()(x), model(x))
    torch.testing.assert_close(_sin_twice(x), x.sin() * 2)


def test_strict_torch_export_of_a_jitted_module():
    """`torch.export.export(fulmen.jit(model), strict=True)` exports the model's own torch
    calls; the jitted module still compiles afterwards."""
    torch.manual_seed(0)
    model = _Block()
    jitted = fulmen.jit(model)
    x = torch.randn(4, 8)
    program = torch.export.export(jitted, (x,), strict=True)
    torch.testing.assert_close(program.module()(x), model(x))
    torch.testing.assert_close(jitted(x), model(x))
    torch.testing.assert_close(jitted(x), model(x))
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_jit_of_a_torch_compiled_module():
    """`fulmen.jit(torch.compile(model))`: explaining the first miss took the module's truth
    value, which `OptimizedModule.__len__` refuses (TypeError "does not support len()")."""
    torch.manual_seed(0)
    model = _Block()
    jitted = fulmen.jit(torch.compile(model, backend="eager"))
    for rows in (4, 5, 6):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(jitted(x), model(x))
    assert fulmen.compile_stats(jitted).eager_calls == 0


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        self.count += 1
        return self.lin(x) * self.count


class _WithScriptedCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.counter = torch.jit.script(_Counter())

    def forward(self, x):
        return self.counter(x).relu()


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_scripted_submodule_that_updates_a_buffer_counts_once_per_call(dynamic):
    """A scripted submodule's `self.count += 1` ran for real while tracing and again in the
    compiled (or eager) call: after the first call the count was 3, not 1, and the outputs
    scaled by it were wrong, silently. Such a call runs eagerly now."""
    torch.manual_seed(0)
    expected_model = _WithScriptedCounter()
    torch.manual_seed(0)
    model = _WithScriptedCounter()
    jitted = fulmen.jit(model, dynamic=dynamic) if dynamic else fulmen.jit(model)
    for calls, rows in enumerate((4, 4, 5, 4), start=1):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(jitted(x), expected_model(x))
        assert model.counter.count.item() == expected_model.counter.count.item() == calls
