"""HF models called the ways users call them, beyond `model(ids)` (session 50's probe of
generate options, forward flags, training and mode switches on tiny configs): the calls that
answered wrongly or ran eagerly, each compared with eager PyTorch."""

import copy
import os

import pytest
import torch

import fulmen

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")


class _Tanh(torch.autograd.Function):
    """A custom Function as BLOOM's GeLUFunction is written: saves its input for backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x) * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * (1 - torch.tanh(x) ** 2)


def test_a_custom_function_under_inference_mode_is_compiled():
    # its outputs were described by running forward on fake tensors made inside inference
    # mode, whose version counter the in-place check reads: the call ran eagerly
    def f(x):
        return _Tanh.apply(x * 3) + 1

    jf = fulmen.jit(f)
    x = torch.randn(4, 5)
    with torch.inference_mode():
        got, want = jf(x), f(x)
    assert got.is_inference() == want.is_inference()
    torch.testing.assert_close(got, want)
    assert fulmen.compile_stats(jf).eager_calls == 0


def test_bloom_under_inference_mode_matches_eager_compiled():
    config = T.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4, pad_token_id=0)
    torch.manual_seed(0)
    model = T.BloomForCausalLM(config).eval()
    jitted = fulmen.jit(copy.deepcopy(model))
    ids = torch.randint(3, 96, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.inference_mode():
        got = jitted(input_ids=ids, attention_mask=mask).logits
        want = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want)
    assert fulmen.compile_stats(jitted).eager_calls == 0
