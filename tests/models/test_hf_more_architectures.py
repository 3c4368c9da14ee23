"""HF architectures beyond causal LMs that once failed under fulmen (found by sweeping the masked
LM, seq2seq and image-classification mappings of transformers 5.24 with tiny random configs):
each against eager on a padded batch, in the mode that failed."""

import copy
import os
import warnings

import pytest
import torch

import fulmen

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")


def _ids():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


def test_longformer_trains_as_eager():
    """`mask.type_as(query)` with a query of another shape was taken for a broadcast operand."""
    torch.manual_seed(0)
    config = T.LongformerConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=64,
                                attention_window=4, max_position_embeddings=64,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = T.LongformerForMaskedLM(config).train()
    twin = copy.deepcopy(model)
    ids, mask = _ids()
    labels = ids.masked_fill(mask == 0, -100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Input ids are automatically padded"
        expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        actual = fulmen.jit(twin)(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(actual, expected)
    expected.backward()
    actual.backward()
    for (name, mine), theirs in zip(twin.named_parameters(), model.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_levit_eval_caches_its_attention_biases_then_compiles():
    """LeViT's eval forward stores `attention_bias_cache[device] = biases` (a traced tensor into
    a dict) on its first call: that call runs eagerly, the next ones compile."""
    torch.manual_seed(0)
    config = T.LevitConfig(image_size=32, hidden_sizes=[16, 24, 32], num_attention_heads=[1, 1, 1],
                           depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=3)
    model = T.LevitForImageClassification(config).eval()
    jitted = fulmen.jit(model)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), pytest.warns(UserWarning, match="attention_bias_cache"):
        for _ in range(3):
            torch.testing.assert_close(jitted(pixels).logits, model(pixels).logits)
    assert fulmen.compile_stats(jitted).eager_calls == 1


def test_switch_transformers_generates_as_eager_with_few_compilations(monkeypatch):
    """Its router moves itself to its dtype in the forward and formats expert indices; fusion
    once emitted a `torch.max` restored whole after a consumer of its values (the experts a
    batch reaches decide the trace: these inputs reach the case, with tiny regions left to
    torch as by default)."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")
    torch.manual_seed(0)
    config = T.SwitchTransformersConfig(num_experts=4, expert_capacity=8, pad_token_id=0,
                                        decoder_start_token_id=0, eos_token_id=1)
    # sizes set after the defaults chose which layers are sparse (as a shrunk hub config)
    for name, value in dict(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                            num_decoder_layers=2).items():
        setattr(config, name, value)
    model = T.SwitchTransformersForConditionalGeneration(config).eval()
    jitted = fulmen.jit(copy.deepcopy(model))
    ids = torch.randint(3, 120, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    ids[1, 5:] = 0
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                  do_sample=False)
        actual = jitted.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                 do_sample=False)
    torch.testing.assert_close(actual, expected)
    stats = fulmen.compile_stats(jitted)
    assert stats.eager_calls == 0 and fulmen.cache_misses(jitted) <= 4
