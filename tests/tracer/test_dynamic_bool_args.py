"""A comparison of symbolic sizes passed as a torch function's `bool` argument (HF attention's
`is_causal=q_len > 1`) is decided with a guard while tracing (`fulmen.tracer.bool_args`),
instead of failing in torch's argument parser and throwing the symbolic trace away. Every call
equals eager, including one on the other side of the comparison (a miss, never a wrong hit)."""

import torch
import torch.nn.functional as F

import fulmen
from tests.spies import record_calls


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 5)


def _positional(q, k, v):  # `is_causal` as the fifth positional argument
    return F.scaled_dot_product_attention(q, k, v, None, 0.0, q.shape[2] > 5)


def test_a_symbolic_is_causal_is_decided_with_a_guard(monkeypatch):
    from fulmen.tracer import layout_truth

    original = F.scaled_dot_product_attention
    # the layout rule still knows the op while the module holds the wrapper (else PyTorch's
    # meta kernel runs the math backend on fake tensors: ~5x the symbolic trace of tiny Llama)
    asked = record_calls(monkeypatch, layout_truth, "eager_layouts")
    for fn in (_attention, _positional):
        jfn = fulmen.jit(fn, dynamic=True)
        for length in (4, 8, 3, 9, 2, 12):  # non-causal at <= 5, causal above
            q, k, v = (torch.randn(2, 3, length, 8) for _ in range(3))
            torch.testing.assert_close(jfn(q, k, v), fn(q, k, v))
        stats = fulmen.compile_stats(jfn)
        # one entry per side of `length > 5` (before: the symbolic trace failed on the SymBool
        # and each length compiled for its exact shapes, 6 compilations)
        assert stats.cache_misses == 2 and stats.eager_calls == 0, stats.recompile_reasons
    assert F.scaled_dot_product_attention is original  # put back after the traces
    assert original not in asked
