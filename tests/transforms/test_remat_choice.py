"""Which forward values the backward recomputes rather than saves: a small reduction is
recomputed (its input is saved anyway), a large one never is (recomputing it costs as much as
the forward); gradients equal eager's either way."""

import pytest
import torch

import fulmen


def _reductions(trace) -> set[str]:
    return {p.name for b in trace.bsyms if b.sym.name.startswith("sum")
            for p in b.proxy_outputs}


@pytest.mark.parametrize("cols", [16, 8192])
def test_only_small_reductions_are_recomputed_in_backward(cols):
    def fn(x, w):
        s = (x * w).sum(dim=1, keepdim=True)
        return (x * s).sin()

    jfn = fulmen.jit(fn, executors=["torch"])
    x, w = torch.randn(4, cols), torch.randn(cols)
    grads = []
    for f in (jfn, fn):
        inputs = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        f(*inputs).sum().backward()
        grads.append([i.grad for i in inputs])
    for actual, expected in zip(*grads):
        torch.testing.assert_close(actual, expected)
    forward = fulmen.last_traces(jfn)[-1]
    backward = fulmen.last_backward_traces(jfn)[-1]
    recomputed = _reductions(forward) & _reductions(backward)
    assert bool(recomputed) == (cols <= 4096)
