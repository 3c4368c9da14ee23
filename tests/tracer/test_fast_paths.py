"""`nn.TransformerEncoder`'s nested-tensor fast path (eval, no grad, key padding mask): a jitted
encoder gives eager's values, zeros at padded positions included (`fulmen.tracer.fast_paths`),
and the regular path's values wherever eager takes that one."""

import copy

import pytest
import torch

import fulmen


def _encoder(norm: bool) -> torch.nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    final = None
    if norm:  # a trained norm: the padded positions hold its bias (0 for a fresh LayerNorm)
        final = torch.nn.LayerNorm(8)
        torch.nn.init.normal_(final.bias)
    return torch.nn.TransformerEncoder(layer, 2, norm=final, enable_nested_tensor=True)


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.encoder = _encoder(norm=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids, padding):
        hidden = self.encoder(self.embed(ids), src_key_padding_mask=padding)
        return self.head(hidden.mean(1))  # averages the padded positions too, as users do


def _right_padded(lengths, seq=6) -> torch.Tensor:
    return torch.arange(seq)[None, :] >= torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("additive", [False, True])
def test_eval_encoder_with_padding_equals_eager(norm, additive):
    model = _encoder(norm).eval()
    jmodel = fulmen.jit(copy.deepcopy(model))
    x = torch.randn(3, 6, 8)
    padding = _right_padded([6, 4, 1])
    if additive:
        padding = torch.zeros(padding.shape).masked_fill(padding, float("-inf"))
    with torch.no_grad():
        expected = model(x, src_key_padding_mask=padding)
        actual = jmodel(x, src_key_padding_mask=padding)
    assert expected[1, 4:].abs().sum() == 0 or norm  # eager's nested path: zeros there
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_masks_alternating_between_fast_and_regular_paths():
    """Left padding is not left-aligned: eager takes the regular path (no zeros). The
    alignment is a guard, so alternating masks never reuse the other path's program."""
    model = _encoder(norm=False).eval()
    jmodel = fulmen.jit(copy.deepcopy(model))
    x = torch.randn(2, 6, 8)
    right = _right_padded([6, 3])
    left = right.flip(-1)
    with torch.no_grad():
        for padding in (right, left, right, left, None):
            torch.testing.assert_close(jmodel(x, src_key_padding_mask=padding),
                                       model(x, src_key_padding_mask=padding),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["train", "grad", "fastpath_off"])
def test_regular_path_where_eager_takes_it(mode):
    model = _encoder(norm=True)
    model.train(mode == "train")
    jmodel = fulmen.jit(copy.deepcopy(model))
    x = torch.randn(2, 6, 8)
    padding = _right_padded([6, 3])
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(mode != "fastpath_off")
    try:
        with torch.set_grad_enabled(mode != "fastpath_off"):
            expected = model(x, src_key_padding_mask=padding)
            actual = jmodel(x, src_key_padding_mask=padding)
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
    assert expected[1, 3:].abs().sum() > 0  # the regular path: no zeros
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_a_classifier_pooling_over_padding_equals_eager_and_leaves_no_hook():
    model = _Classifier().eval()
    jmodel = fulmen.jit(model)
    ids = torch.randint(0, 20, (3, 6))
    padding = _right_padded([6, 2, 4])
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(jmodel(ids, padding), model(ids, padding),
                                       rtol=1e-5, atol=1e-5)
    assert fulmen.cache_misses(jmodel) == 1
    assert not model.encoder._forward_hooks and not model.encoder._forward_hooks_with_kwargs


def test_fast_path_switched_off_and_on_between_calls():
    """The switch is keyed: the fast path's trace (zeros at padded positions) served a call
    with the fast path off, where eager computes the padded positions."""
    model = _encoder(norm=False).eval()
    jmodel = fulmen.jit(copy.deepcopy(model))
    x = torch.randn(2, 6, 8)
    padding = _right_padded([6, 3])
    before = torch.backends.mha.get_fastpath_enabled()
    try:
        with torch.no_grad():
            for enabled in (True, False, True):
                torch.backends.mha.set_fastpath_enabled(enabled)
                torch.testing.assert_close(jmodel(x, src_key_padding_mask=padding),
                                           model(x, src_key_padding_mask=padding),
                                           rtol=1e-5, atol=1e-5)
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
    assert fulmen.cache_misses(jmodel) == 2
