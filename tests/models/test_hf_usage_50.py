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


class _Store:
    """A cache object as Reformer's: made by the forward, filled by each layer."""

    def __init__(self):
        self.items = []


class _Counted(torch.autograd.Function):
    """Reformer's reversible layers: forward reads how many layers the cache it gets holds,
    adds one, or appends to a list it gets (the hidden states)."""

    @staticmethod
    def forward(ctx, x, store):
        if isinstance(store, list):
            store.append(x.shape[0])
            return x * 2
        out = x * (len(store.items) + 1)
        store.items.append(1)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _held_object(x):
    return _Counted.apply(x, _Store())


def _held_list(x):
    seen = []
    return _Counted.apply(x, seen), len(seen)


@pytest.mark.parametrize("fn", [_held_object, _held_list])
def test_a_custom_function_that_changes_python_objects_it_gets_runs_as_eager(fn):
    # the fake run describing the outputs appended to the object, and the compiled call
    # passed the object kept from tracing: x * 2 (then x * 3, ...) where eager gives x; the
    # list was a copy, so the caller's stayed empty (length 0, eager's 1)
    jf = fulmen.jit(fn)
    for n in (3, 3, 5):
        x = torch.randn(n, 2)
        torch.testing.assert_close(jf(x), fn(x))


class _Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n):
        return x[:n] * 2

    @staticmethod
    def backward(ctx, grad):
        return None, None


def test_a_custom_function_getting_a_symbolic_size_is_compiled_once():
    # a size is no object forward can change (Reformer's masked LM passes one under
    # dynamic shapes): the calls stay compiled
    def f(x):
        return _Head.apply(x, x.shape[0] - 1)

    jf = fulmen.jit(f, dynamic=True)
    for n in (4, 5, 6):
        x = torch.randn(n, 3)
        torch.testing.assert_close(jf(x), f(x))
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
