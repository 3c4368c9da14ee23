"""A fused AdamW step (`torch._fused_adamw_`) on gradients the user sets with a stride-0
dimension (`p.grad = g.expand(...)`) compiles and equals eager: the fused kernels write their
`grads` only to unscale them (`grad_scale`), so the trace no longer records a write to them
(NOTE [fused optimizers write their grads only to unscale them] in `tracer/aten_inplace.py`);
it was refused as a self-overlapping in-place update (NotYetSupportedError)."""

import warnings

import pytest
import torch
from torch import nn

import fulmen


def _expanded(value: float, shape) -> torch.Tensor:
    # a stride-0 gradient whose storage holds as many equal elements as it has (eager's CPU
    # kernel reads the gradient as contiguous memory: so eager's answer is defined)
    numel = 1
    for size in shape:
        numel *= size
    return torch.full((numel,), value)[:1].expand(*shape)


def _loop(jit: bool, fused: bool = True):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01, fused=fused)

    def step():
        opt.step()

    fn = fulmen.jit(step) if jit else step
    for i in range(4):
        for p in model.parameters():
            p.grad = _expanded(0.5 + i, p.shape)
            assert 0 in p.grad.stride()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    state = [value for per_param in opt.state.values() for value in per_param.values()]
    grads = [p.grad.clone() for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()] + grads + state, fn


@pytest.mark.parametrize("fused", [True, False])
def test_fused_adamw_on_stride_0_grads_compiles_as_eager(fused):
    want, _ = _loop(False, fused)
    got, fn = _loop(True, fused)
    assert len(got) == len(want) > 4
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    stats = fulmen.compile_stats(fn)
    assert stats.calls == 4
    # the first call runs eagerly (deferred), the others compiled: no eager fallback
    assert stats.eager_calls <= 1 and stats.cache_hits >= 2
