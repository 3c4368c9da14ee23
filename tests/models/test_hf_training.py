"""HF models trained the ways users train them: gradient checkpointing, an embedding resized
between steps. Losses and gradients are compared with eager by the float64 rule."""

import copy
import os
import warnings

import pytest
import torch

import fulmen
from fulmen.tools.accuracy import assert_accurate, to_float64

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")


def _tiny_llama(layers=2):
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=96, max_position_embeddings=64, pad_token_id=0))


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(3, 96, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def _loss_and_grads(model, batch, call=None) -> tuple[torch.Tensor, dict]:
    loss = (call or model)(**batch).loss
    loss.backward()
    return loss, {n: torch.zeros_like(p) if p.grad is None else p.grad
                  for n, p in model.named_parameters()}


def _enable_checkpointing(model, spelling):
    if spelling == "gradient" or not hasattr(model, "activation_checkpointing_enable"):
        with warnings.catch_warnings():  # deprecated since transformers 5.24
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
    elif spelling == "every_2":
        model.activation_checkpointing_enable(every_n_layers=2)
    else:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": True})


@pytest.mark.parametrize("spelling", ["gradient", "every_2", "reentrant"])
def test_gradient_checkpointing_matches_eager(spelling):
    """`gradient_checkpointing_enable()` (transformers >= 5.24: `activation_checkpointing_enable`,
    which may checkpoint every n-th layer only) registers a forward hook that calls
    `output.requires_grad_(True)` on the embeddings' output (already requiring grad)."""
    model = _tiny_llama(layers=3).train()
    twin, wide = copy.deepcopy(model), copy.deepcopy(model).double()
    for m in (model, twin, wide):
        _enable_checkpointing(m, spelling)
    batch = _batch()
    want_loss, want = _loss_and_grads(model, batch)
    got_loss, got = _loss_and_grads(twin, batch, fulmen.jit(twin))
    ref_loss, ref = _loss_and_grads(wide, to_float64(batch))
    assert_accurate(got_loss, want_loss, ref_loss, what="loss")
    for name in want:
        assert_accurate(got[name], want[name], ref[name], what=f"grad of {name}")


def test_resized_embeddings_are_used_by_the_next_call():
    model = _tiny_llama().eval()
    jmodel = fulmen.jit(model)
    ids = _batch()["input_ids"]
    jmodel(input_ids=ids)
    model.resize_token_embeddings(100)
    got, want = jmodel(input_ids=ids).logits, model(input_ids=ids).logits
    assert got.shape == want.shape == (2, 8, 100)
    torch.testing.assert_close(got, want)


def test_umt5_with_dropout_and_padding_draws_eagers_masks():
    """UMT5 in training mode on a padded batch: its attention (dropout_p) and its dropouts draw
    in eager's order, so under one seed loss and gradients equal eager's (fusion once emitted
    the first attention's draw after three later dropouts)."""
    torch.manual_seed(0)
    config = T.UMT5Config(vocab_size=96, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                          num_heads=2, dropout_rate=0.1, decoder_start_token_id=0)
    model = T.UMT5ForConditionalGeneration(config).train()
    twin = copy.deepcopy(model)
    batch = _batch()
    batch["labels"] = batch["labels"][:, :5].clamp(min=0)
    jitted = fulmen.jit(twin)
    for _ in range(2):
        model.zero_grad()
        twin.zero_grad()
        torch.manual_seed(5)
        loss, grads = _loss_and_grads(model, batch)
        torch.manual_seed(5)
        jitted_loss, jitted_grads = _loss_and_grads(twin, batch, jitted)
        torch.testing.assert_close(jitted_loss, loss)
        for name, grad in grads.items():
            torch.testing.assert_close(jitted_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_wav2vec2_training_compiles_its_fresh_leaf():
    """The wav2vec2 feature encoder sets `hidden_states.requires_grad = True` on a view of the
    input while training (NOTE [fresh leaves]): compiled, with eager's loss and gradients; it
    once ran every training call eagerly. (SpecAugment, which draws from NumPy, is off.)"""
    torch.manual_seed(0)
    config = T.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, num_labels=3, classifier_proj_size=16,
        mask_time_prob=0.0, layerdrop=0.0, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0)
    model = T.Wav2Vec2ForSequenceClassification(config).train()
    twin = copy.deepcopy(model)
    batch = dict(input_values=torch.randn(2, 400), labels=torch.tensor([0, 2]))
    jitted = fulmen.jit(twin, fullgraph=True)
    loss, grads = _loss_and_grads(model, batch)
    jitted_loss, jitted_grads = _loss_and_grads(twin, batch, jitted)
    torch.testing.assert_close(jitted_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(jitted_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
