"""HF encoder heads and padded classifiers: tiny configs, random weights, no downloads.

The sweep of issue 18 over the masked-LM, sequence-classification, multiple-choice,
next-sentence, question-answering and token-classification mappings of transformers (eager vs
`fulmen.jit`: a training step with labels and gradients, eval under `no_grad` with right and
left padding, repeated calls) kept these patterns that no other test covers: BigBird's
block-sparse attention and question-answering head, which change tensors' shapes in place
(`unsqueeze_` on locals) and build a mask with `dtype=int`; a decoder classifier pooling each
row's last real token of a left-padded batch; multiple choice (three-dimensional ids flattened
and the logits regrouped per example); BERT's pre-training heads (masked LM and next sentence).
"""

import copy
import os
import warnings

import pytest
import torch

import fulmen
from tests.models.test_hf_vision_audio import _train_step_matches

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

VOCAB = 96
_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=64, max_position_embeddings=64, pad_token_id=0)


def _ids(shape, seed, pad=None):
    """Random ids with the positions of `pad` (an index) set to the pad token 0."""
    ids = torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))
    if pad is not None:
        ids[pad] = 0
    return ids, (ids != 0).long()


def _no_fallback(jitted):
    stats = fulmen.compile_stats(jitted)
    assert stats.eager_calls == 0, stats.recompile_reasons


def test_bigbird_block_sparse_question_answering_compiles_as_eager():
    """The block-sparse attention and the QA head call `unsqueeze_` on tensors they made
    (NOTE [in-place metadata changes]); the question mask is `torch.ones(..., dtype=int)`."""
    config = T.BigBirdConfig(**_BERT, block_size=2, num_random_blocks=1, sep_token_id=2,
                             attention_type="block_sparse")
    torch.manual_seed(0)
    model = T.BigBirdForQuestionAnswering(config).eval()
    jitted = fulmen.jit(copy.deepcopy(model))
    for seed in (1, 2):  # the second call hits the cache
        ids, mask = _ids((2, 24), seed, pad=(1, slice(20, None)))
        ids[:, 5] = 2  # the question ends at the first separator
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")  # "runs eagerly" is a warning
            want = model(input_ids=ids, attention_mask=mask)
            got = jitted(input_ids=ids, attention_mask=mask)
        torch.testing.assert_close((got.start_logits, got.end_logits),
                                   (want.start_logits, want.end_logits))
    _no_fallback(jitted)
    assert fulmen.compile_stats(jitted).cache_hits == 1


@pytest.mark.slow  # ~10 s; the sweep's script runs it for every type
def test_decoder_classifier_pools_the_last_real_token_of_left_padded_rows():
    torch.manual_seed(0)
    model = T.LlamaForSequenceClassification(T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, head_dim=8, pad_token_id=0,
        num_labels=3)).train()
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(twin)
    ids, mask = _ids((3, 9), 1, pad=(1, slice(None, 4)))  # left padding
    _train_step_matches(model, jitted, twin, dict(input_ids=ids, attention_mask=mask,
                                                  labels=torch.tensor([0, 2, 1])))
    model.eval(), twin.eval()
    with torch.no_grad():
        for seed, pad in ((2, (0, slice(6, None))), (3, (2, slice(None, 3)))):  # right, left
            ids, mask = _ids((3, 9), seed, pad=pad)
            torch.testing.assert_close(jitted(input_ids=ids, attention_mask=mask).logits,
                                       model(input_ids=ids, attention_mask=mask).logits)
    _no_fallback(jitted)


def test_multiple_choice_over_padded_choices_trains_as_eager():
    torch.manual_seed(0)
    model = T.BertForMultipleChoice(T.BertConfig(**_BERT)).train()
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(twin)
    ids, mask = _ids((2, 3, 7), 1, pad=(1, slice(None), slice(5, None)))
    ids[0, 1, 6:] = 0
    mask = (ids != 0).long()
    inputs = dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([2, 0]))
    _train_step_matches(model, jitted, twin, inputs)
    model.eval(), twin.eval()
    with torch.no_grad():
        ids, mask = _ids((2, 3, 7), 2, pad=(0, 2, slice(4, None)))
        torch.testing.assert_close(jitted(input_ids=ids, attention_mask=mask).logits,
                                   model(input_ids=ids, attention_mask=mask).logits)
    _no_fallback(jitted)


@pytest.mark.slow  # ~10 s; the sweep's script runs it for every type
def test_bert_pretraining_heads_train_as_eager():
    """Masked LM and next-sentence losses together (`BertForPreTraining`)."""
    torch.manual_seed(0)
    model = T.BertForPreTraining(T.BertConfig(**_BERT)).train()
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(twin)
    ids, mask = _ids((2, 9), 1, pad=(1, slice(7, None)))
    labels = torch.where(mask.bool() & (ids % 3 == 0), ids, -100)
    inputs = dict(input_ids=ids, attention_mask=mask, token_type_ids=(torch.arange(9) > 4).long()
                  .expand(2, 9), labels=labels, next_sentence_label=torch.tensor([0, 1]))
    torch.manual_seed(0)
    expected = model(**inputs)
    torch.manual_seed(0)
    actual = jitted(**inputs)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(actual.seq_relationship_logits, expected.seq_relationship_logits,
                               rtol=1e-4, atol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)
    _no_fallback(jitted)
