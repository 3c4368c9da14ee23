"""Training-loop tools users jit (session 51's probe), compared with eager over several steps:
updates of parameters through `p.detach()` / `p.data` with grad on (an EMA's
`AveragedModel.update_parameters`, a hand-written EMA or weight clamp), which eager makes
outside autograd as one under `torch.no_grad()`."""

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fulmen


def _ema_run(jit: bool, dynamic, **averaging):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = AveragedModel(model, **averaging)
    update = fulmen.jit(ema.update_parameters, dynamic=dynamic) if jit else ema.update_parameters
    seen = []
    for step in range(4):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        update(model)
        seen += [ema.n_averaged.clone(), *(p.detach().clone() for p in ema.parameters())]
    return seen, update


@pytest.mark.parametrize(("averaging", "dynamic"), [("ema", None), ("swa", True)])
def test_averaged_models_update_compiles(averaging, dynamic):
    """`fulmen.jit(ema.update_parameters)`: it copies (first call) or averages into
    `p_averaged.detach()` with grad on, which the tracer took for an update autograd records
    into a parameter requiring grad: every call ran eagerly."""
    options = dict(multi_avg_fn=get_ema_multi_avg_fn(0.9)) if averaging == "ema" else {}
    want, _ = _ema_run(False, dynamic, **options)
    got, update = _ema_run(True, dynamic, **options)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    stats = fulmen.compile_stats(update)
    assert stats.calls == 4 and stats.eager_calls == 0, stats.recompile_reasons


def _detach_copy(layer, x, p):
    layer.weight.detach().copy_(layer.bias.detach()[:, None] * 0.5)
    return x + 1


def _data_mul(layer, x, p):
    layer.weight.data.mul_(0.5)
    return x * 2


def _argument_clamp(layer, x, p):
    p.data.clamp_(-0.2, 0.2)  # WGAN's weight clipping
    return x - 1


def _update_then_forward(layer, x, p):  # the forward reads the updated leaf with grad: eager
    layer.weight.detach().mul_(0.5)
    return layer(x)


@pytest.mark.parametrize("fn", [_detach_copy, _data_mul, _argument_clamp, _update_then_forward])
@pytest.mark.parametrize("dynamic", [None, True])
def test_updates_through_detach_or_data_with_grad_on(fn, dynamic):
    torch.manual_seed(0)
    layers = [nn.Linear(3, 2), None]
    layers[1] = copy.deepcopy(layers[0])
    params = [nn.Parameter(torch.randn(5)), None]
    params[1] = nn.Parameter(params[0].detach().clone())
    jf = fulmen.jit(fn, dynamic=dynamic)
    for step in range(3):
        x = torch.randn(4 + step % 2, 3)
        outs = [call(layer, x, p) for call, layer, p in zip((fn, jf), layers, params)]
        for out in outs:
            (out.sum() + params[out is outs[1]].sum()).backward()
        torch.testing.assert_close(outs[1], outs[0])
        for a, b in zip([*layers[1].parameters(), params[1]], [*layers[0].parameters(), params[0]]):
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(a.grad, b.grad)
            assert a.requires_grad and a.is_leaf
    stats = fulmen.compile_stats(jf)
    assert stats.eager_calls == (3 if fn is _update_then_forward else 0), stats.recompile_reasons


class _TwoHeads(nn.Module):
    """A model returning a second output nobody backpropagates (hidden states past the layer
    a vision tower's features are taken from, in LLaVA; an auxiliary head)."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(6, 2)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head(h).square().mean(), self.aux(h)


@pytest.mark.parametrize("dynamic", [None, True])
def test_parameters_reached_only_from_unused_outputs_get_no_grad_at_symbolic_sizes(dynamic):
    """With symbolic sizes (batch 3, then 4, 5) autograd materialized zeros for the unused
    output and the backward gave its head zero gradients, where eager leaves them None:
    AdamW then decayed and moved the head eager leaves alone."""
    torch.manual_seed(0)
    models = [_TwoHeads(), None]
    models[1] = copy.deepcopy(models[0])
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in models]
    jitted = fulmen.jit(models[1], dynamic=dynamic)
    for step in range(3):
        x = torch.randn(3 + step, 4)
        for call in (models[0], jitted):
            loss, _ = call(x)
            loss.backward()
        for a, b in zip(models[1].parameters(), models[0].parameters()):
            assert (a.grad is None) == (b.grad is None)
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    for a, b in zip(models[1].parameters(), models[0].parameters()):
        torch.testing.assert_close(a, b)
    assert fulmen.compile_stats(jitted).eager_calls == 0


class _Separate(nn.Module):
    """Two outputs sharing no saved tensor (a generator's and a discriminator's loss)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x).sin().sum(), self.b(x).cos()


def test_outputs_backpropagated_in_turns_at_symbolic_sizes():
    """`loss.backward()` then `aux.sum().backward()` works in eager (two graphs); at symbolic
    sizes the first backward freed every residual of the one compiled node and the second
    raised "Trying to backward through the graph a second time"."""
    torch.manual_seed(0)
    models = [_Separate(), None]
    models[1] = copy.deepcopy(models[0])
    jitted = fulmen.jit(models[1], dynamic=True)
    for step in range(2):
        x = torch.randn(3 + step, 4)
        for call in (models[0], jitted):
            loss, aux = call(x)
            loss.backward()
            aux.sum().backward()
        for a, b in zip(models[1].parameters(), models[0].parameters()):
            torch.testing.assert_close(a.grad, b.grad)
            a.grad = b.grad = None
    assert fulmen.compile_stats(jitted).eager_calls == 0
