"""Composite ops under CPU `torch.autocast` (known failures, session 49).

`fulmen.tracer.autocast` records the casts autocast applies to an op's *arguments* (from a run
on fake tensors) and runs the op without autocast. A composite op that autocast reaches inside
(`torch.gru` / `rnn_tanh` / `lstm`, whose CPU kernels call `linear` per step; the cross-attention
`F.multi_head_attention_forward`, whose `_in_projection_packed` slices the packed weight and
autocast casts the slices) gets its arguments cast but not the tensors made inside it, so the
compiled call raises PyTorch's dtype error (`mat1 and mat2 must have the same dtype`, or oneDNN's
LSTM primitive error) where eager runs. Not silent, but misleading; these tests pin it until
such ops run with autocast's own state or raise `NotYetSupportedError`.
"""

import pytest
import torch

import fulmen

_CASES = {
    "gru": (lambda: torch.nn.GRU(4, 5), lambda: (torch.randn(3, 2, 4),)),
    "rnn_tanh": (lambda: torch.nn.RNN(4, 5), lambda: (torch.randn(3, 2, 4),)),
    "lstm": (lambda: torch.nn.LSTM(4, 5), lambda: (torch.randn(3, 2, 4),)),
    "cross_attention": (lambda: torch.nn.MultiheadAttention(8, 2),
                        lambda: (torch.randn(5, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8))),
    "decoder_layer": (lambda: torch.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0),
                      lambda: (torch.randn(5, 2, 8), torch.randn(3, 2, 8))),
}


@pytest.mark.xfail(strict=True, reason="autocast inside composite ops (RNN kernels, cross-"
                   "attention's packed projection): the compiled call raises a dtype error")
@pytest.mark.parametrize("case", sorted(_CASES))
def test_composite_op_under_cpu_autocast_runs_as_eager(case):
    make, inputs = _CASES[case]
    torch.manual_seed(0)
    module = make()
    args = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = module(*args)
        got = fulmen.jit(module)(*args)
    want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
