"""HF vision and audio heads in training mode: tiny configs, random weights, no downloads.

The sweep of issue 18 ran every image-classification, audio-classification, CTC, semantic
segmentation, detection and speech seq2seq type of transformers against fulmen (eager vs
`fulmen.jit`: a training step with labels, eval under `no_grad`, other batch sizes and lengths).
These are the patterns it exercised that no other test covers, kept small: BatchNorm in training
mode (running statistics are stores on buffers), channels-last convolutions (the gradient of a
channels-last weight is channels-last in eager), CTC loss over the lengths a conv feature
extractor computes from the attention mask, and a segmentation loss with `ignore_index=255`
over logits upsampled by `F.interpolate`.
"""

import copy
import os

import pytest
import torch

import fulmen
from tests.layouts import significant_strides

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")


def _resnet():
    return T.ResNetForImageClassification(T.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3))


def _convnext():
    return T.ConvNextForImageClassification(T.ConvNextConfig(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, image_size=32))


def _segformer():
    return T.SegformerForSemanticSegmentation(T.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 1], mlp_ratios=[2, 2],
        decoder_hidden_size=16, num_labels=3))


def _wav2vec2_ctc():
    return T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, conv_dim=[8, 8], conv_stride=[5, 2], conv_kernel=[10, 3],
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, feat_extract_norm="layer",
        do_stable_layer_norm=True, layerdrop=0.0, mask_time_prob=0.0, hidden_dropout=0.0,
        activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, pad_token_id=0, ctc_loss_reduction="mean"))


def _image_inputs(batch, channels_last=False):
    pixels = torch.randn(batch, 3, 32, 32)
    if channels_last:
        pixels = pixels.to(memory_format=torch.channels_last)
    return dict(pixel_values=pixels, labels=torch.randint(0, 3, (batch,)))


def _segmentation_inputs(batch):
    labels = torch.randint(0, 3, (batch, 32, 32))
    labels[:, :4] = 255  # ignored
    return dict(pixel_values=torch.randn(batch, 3, 32, 32), labels=labels)


def _ctc_inputs(batch, length):
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, length * 3 // 4:] = 0
    return dict(input_values=torch.randn(batch, length), attention_mask=mask,
                labels=torch.randint(1, 16, (batch, 4)))


def _train_step_matches(model, jitted, twin, inputs):
    """One training step (forward with labels, backward) of `model` eagerly and of `jitted`
    (which wraps `twin`, a copy): the loss, the logits, every gradient with its strides (on
    dimensions of size other than 1: a 1x1 convolution's weight gradient is strided there), and
    every floating buffer (BatchNorm's running statistics) agree."""
    torch.manual_seed(0)
    expected = model(**inputs)
    torch.manual_seed(0)
    actual = jitted(**inputs)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(actual.logits, expected.logits, rtol=1e-4, atol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)
            assert significant_strides(q.grad) == significant_strides(p.grad), name
    for (name, b), (_, c) in zip(model.named_buffers(), twin.named_buffers()):
        torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("make", [_resnet, _convnext], ids=["resnet", "convnext"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_conv_image_classifier_trains_as_eager(make, channels_last):
    torch.manual_seed(0)
    model = make().train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(twin)
    _train_step_matches(model, jitted, twin, _image_inputs(2, channels_last))
    model.eval()
    twin.eval()
    with torch.no_grad():
        inputs = _image_inputs(3, channels_last)
        expected, actual = model(**inputs).logits, jitted(**inputs).logits
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    assert actual.stride() == expected.stride() and not actual.requires_grad
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_segformer_segmentation_loss_ignores_255_as_eager():
    torch.manual_seed(0)
    model = _segformer().train()
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(twin)
    _train_step_matches(model, jitted, twin, _segmentation_inputs(2))
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_wav2vec2_ctc_trains_as_eager_over_three_lengths():
    """The third length compiles with symbolic sizes: the feature extractor's output lengths
    (`_get_feat_extract_output_lengths`) and the CTC loss's input lengths come from them."""
    torch.manual_seed(0)
    model = _wav2vec2_ctc().train()
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(twin)
    for batch, length in ((2, 800), (3, 640), (2, 960)):
        model.zero_grad()
        twin.zero_grad()
        _train_step_matches(model, jitted, twin, _ctc_inputs(batch, length))
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_channels_last_group_norm_then_conv_backward_as_eager(monkeypatch):
    """Found by the session 47 vision sweep (BiT made channels-last, one training step: every
    gradient below a weight-standardized 1x1 conv O(1) off eager's). A group norm of a
    channels-last input is channels-last on CPU, but was traced row-major; a 1x1 conv whose
    weight is row-major at (8, 1, 1, 1) strides (BiT's standardized weight, `reshape_as` of a
    batch norm's output) then followed the traced layout, and the next group norm's backward
    handed eager's channels-last kernel a row-major gradient. Not fused (FUSE_TINY=0: the
    partition users get), where the group norms run eager's kernels."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")
    torch.manual_seed(0)
    x0 = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    weight0 = torch.randn(8, 8, 1, 1)
    scale0, shift0, upstream = torch.randn(8), torch.randn(8), torch.randn(2, 8, 6, 6)

    def block(x, weight, scale, shift):
        h = torch.relu(torch.nn.functional.group_norm(x, 4, scale, shift))
        return torch.nn.functional.group_norm(torch.nn.functional.conv2d(h, weight), 4, scale,
                                              shift)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (x0, weight0, scale0, shift0)]
        (fn(*leaves) * upstream).sum().backward()
        return [leaf.grad for leaf in leaves]

    for actual, expected in zip(grads(fulmen.jit(block)), grads(block)):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)



def test_conv_of_a_fused_channels_last_tensor_returns_eagers_strides():
    """Found by the session 47 vision sweep (Segformer's segmentation logits, eval, once the
    kernels were compiled): a fused region's kernel writes a row-major result where eager's is
    channels-last (`relu` of a channels-last tensor), and a convolution torch runs whole follows
    the layout it is handed: the returned logits were row-major, eager's channels-last. A
    returned tensor computed from a fused tensor laid out otherwise than eager's goes through
    `as_layout` too."""
    from fulmen.executors.codegen import set_compile_policy

    previous = set_compile_policy("eager")  # the kernel, not its (re-laid) torch fallback
    try:
        x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
        weight = torch.randn(3, 8, 1, 1)

        def head(x):
            return torch.nn.functional.conv2d(torch.relu(x * 2), weight)

        expected, actual = head(x), fulmen.jit(head)(x)
    finally:
        set_compile_policy(previous.mode, previous.hot_calls)
    torch.testing.assert_close(actual, expected)
    assert expected.stride() != expected.contiguous().stride()  # not vacuous
    assert actual.stride() == expected.stride()


def test_group_norm_of_a_fused_channels_last_tensor_backward_as_eager():
    """A group norm's backward hands eager's CPU kernel the cotangent in its input's layout;
    that layout was read from the trace (channels-last for `relu(x * 2)` of a channels-last x),
    but the fused kernel computing the input wrote it row-major, and the kernel read the
    channels-last cotangent as row-major: every gradient O(1) off eager's. The layout is now
    decided when the backward runs (`in_layout_of` the input)."""
    from fulmen.executors.codegen import set_compile_policy

    x0 = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    scale0, shift0, upstream = torch.randn(8), torch.randn(8), torch.randn(2, 8, 6, 6)

    def block(x, scale, shift):
        return torch.nn.functional.group_norm(torch.relu(x * 2), 4, scale, shift)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (x0, scale0, shift0)]
        (fn(*leaves) * upstream).sum().backward()
        return [leaf.grad for leaf in leaves]

    previous = set_compile_policy("eager")  # the kernel, not its (re-laid) torch fallback
    try:
        actual = grads(fulmen.jit(block))
    finally:
        set_compile_policy(previous.mode, previous.hot_calls)
    for got, want in zip(actual, grads(block)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
