"""Follow-ups of NOTE [flags of closed-over tensors]: a miss after a flag flip is explained by
the flag's name (`FlagReads.describe`), not by the attributes the key grew by when the first
trace reached a held module."""

import torch

import fulmen


def test_a_requires_grad_flip_is_explained_by_the_flags_name():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    w = torch.randn(3)

    def forward(x):
        y = layer(x)
        y = y * 2 if layer.weight.requires_grad else y * 3
        return y + w if w.requires_grad else y

    jitted = fulmen.jit(forward)
    for frozen in (False, False, True, True):
        layer.requires_grad_(not frozen)
        x = torch.randn(2, 4)
        torch.testing.assert_close(jitted(x), forward(x))
    w.requires_grad_(True)
    x = torch.randn(2, 4)
    torch.testing.assert_close(jitted(x), forward(x))
    stats = fulmen.compile_stats(jitted)
    assert stats.eager_calls == 0
    assert stats.recompile_reasons == [
        ["layer.weight.requires_grad changed from True to False"],
        ["w.requires_grad changed from False to True"]]


def test_a_gradient_appearing_or_changing_strides_is_explained_by_name():
    p = torch.nn.Parameter(torch.randn(3))

    def f(x):
        return x + 1 if p.grad is None else x * p.grad

    jitted = fulmen.jit(f)
    for step in range(4):
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), f(x))
        if step == 1:
            p.grad = torch.ones(3)
        if step == 2:
            p.grad = torch.ones(1).expand(3)
    reasons = fulmen.compile_stats(jitted).recompile_reasons
    assert reasons == [
        ["p.grad changed from None to '<tensor (3,) torch.float32 stride (1,)>'"],
        ["p.grad changed from '<tensor (3,) torch.float32 stride (1,)>' to "
         "'<tensor (3,) torch.float32 stride (0,)>'"]]


def test_a_jitted_modules_read_of_its_own_parameters_grad_is_named():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)

        def forward(self, x):
            g = self.linear.weight.grad
            return self.linear(x) if g is None else self.linear(x) - g.sum()

    torch.manual_seed(0)
    model = Scaled()
    jitted = fulmen.jit(model)
    for _ in range(3):
        x = torch.randn(2, 3)
        got, want = jitted(x), model(x)
        torch.testing.assert_close(got, want)
        want.sum().backward()
    reasons = fulmen.compile_stats(jitted).recompile_reasons
    assert reasons[-1] == [
        "linear.weight.grad changed from None to '<tensor (3, 3) torch.float32 stride (3, 1)>'"]
