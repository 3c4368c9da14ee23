"""`nn.TransformerEncoder`'s nested-tensor fast path (eval, no grad, key padding mask): a jitted
encoder gives eager's values, zeros at padded positions included (`fulmen.tracer.fast_paths`),
and the regular path's values wherever eager takes that one. `nn.MultiheadAttention`'s fast
path: eager's row-major output (viewable), NaN on fully masked rows as eager's kernel gives."""

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


class _SelfAttention(torch.nn.Module):
    """Self-attention whose output the caller views flat, as users of a batch-first
    `nn.MultiheadAttention` do."""

    def __init__(self, flat: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.flat = flat

    def forward(self, x, **masks):
        out, weights = self.attention(x, x, x, need_weights=False, **masks)
        return out.view(-1, 8) if self.flat else None, out, weights


def _attention_both(model, x, **masks):
    jmodel = fulmen.jit(copy.deepcopy(model))
    with torch.no_grad():
        return model(x, **masks), jmodel(x, **masks)


def test_multihead_attention_fast_path_output_is_viewable_and_row_major_as_eager():
    """Eager's fast path returns a new row-major (batch, seq, embed) tensor; traced, the
    regular path's transposed view made `out.view(-1, embed)` raise where eager's worked."""
    model = _SelfAttention().eval()
    x = torch.randn(2, 5, 8)
    padding = _right_padded([5, 3], seq=5)
    for masks in ({}, {"key_padding_mask": padding}):
        want, got = _attention_both(model, x, **masks)
        assert got[1].stride() == want[1].stride() == (40, 8, 1)
        torch.testing.assert_close(got[:2], want[:2])


def test_multihead_attention_fast_path_gives_nan_on_fully_masked_rows_as_eager():
    """Left padding under a causal mask leaves the first queries of a row no key: eager's
    fast-path kernel gives NaN there (a softmax of -inf alone), the regular path zeros."""
    model = _SelfAttention().eval()
    x = torch.randn(2, 5, 8)
    padding = _right_padded([5, 3], seq=5).flip(-1)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    want, got = _attention_both(model, x, key_padding_mask=padding, attn_mask=causal)
    assert want[1][1, :2].isnan().all() and not want[1][1, 2:].isnan().any()
    torch.testing.assert_close(got[:2], want[:2], equal_nan=True)


def test_multihead_attention_regular_path_where_eager_takes_it():
    """A float mask, training or grad keep eager on the regular path: its transposed output
    (which `view` refuses, in eager as traced)."""
    model = _SelfAttention(flat=False)
    x = torch.randn(2, 5, 8)
    additive = torch.zeros(2, 5).masked_fill(_right_padded([5, 3], seq=5), float("-inf"))
    for training, masks in ((False, {"key_padding_mask": additive}), (True, {})):
        want, got = _attention_both(model.train(training), x, **masks)
        assert got[1].stride() == want[1].stride() == (8, 16, 1)
        torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("padding", ["left_causal", "empty_sequence"])
def test_encoder_layers_fast_path_gives_nan_on_fully_masked_rows_as_eager(padding):
    """Eager's encoder-layer fast path (`torch._transformer_encoder_layer_fwd`) gives NaN on
    query rows with no key left (left padding under a causal mask, a sequence all padding);
    the traced regular path computed numbers there."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 8)
    if padding == "left_causal":
        masks = {"src_key_padding_mask": _right_padded([5, 3], seq=5).flip(-1),
                 "mask": torch.ones(5, 5, dtype=torch.bool).triu(1)}
    else:
        masks = {"src_key_padding_mask": _right_padded([5, 0], seq=5)}
    with torch.no_grad():
        want = model(x, **masks)
        got = fulmen.jit(copy.deepcopy(model))(x, **masks)
    assert want.isnan().any() and not want[0].isnan().any()  # not vacuous
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("dynamic", [None, True])
def test_modules_a_jitted_function_calls_give_their_fast_path_results_as_eager(dynamic):
    """`fulmen.jit(lambda x, p: encoder(x, src_key_padding_mask=p))`: the encoder and the
    attention are called by a jitted function, not jitted themselves. The hooks went on the
    jitted module's submodules only, so the padded positions held the regular path's numbers
    (eager: zeros, then the final norm) and the attention output its transposed layout."""
    encoder = _encoder(norm=True).eval()
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    run_encoder = fulmen.jit(lambda x, p: encoder(x, src_key_padding_mask=p), dynamic=dynamic)
    run_attention = fulmen.jit(lambda x: attention(x, x, x, need_weights=False)[0],
                               dynamic=dynamic)
    with torch.no_grad():
        for lengths in ([6, 3], [4, 5, 2]):
            x = torch.randn(len(lengths), 6, 8)
            padding = _right_padded(lengths)
            want = encoder(x, src_key_padding_mask=padding)
            # eager's padded positions: the final norm of zeros, its (nonzero) bias
            assert torch.allclose(want[padding], encoder.norm.bias.expand(int(padding.sum()), 8))
            torch.testing.assert_close(run_encoder(x, padding), want, rtol=1e-5, atol=1e-5)
            got, want = run_attention(x), attention(x, x, x, need_weights=False)[0]
            assert got.stride() == want.stride() == (48, 8, 1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fulmen.compile_stats(run_encoder).eager_calls == 0
    assert not torch.nn.modules.module._global_forward_hooks
