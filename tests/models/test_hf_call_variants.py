"""HF models called the other ways users call them: asking for hidden states and attentions
(newest transformers installs its output-capturing hooks inside the first such forward),
`inputs_embeds` with a gradient back to them, `logits_to_keep`, `return_dict=False`."""

import copy
import os

import pytest
import torch

import fulmen

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from tests.models.test_hf_models import MODELS  # noqa: E402


def _flat(out):
    out = out.to_tuple() if hasattr(out, "to_tuple") else out
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _batch():
    ids = torch.randint(3, 96, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hidden_states_and_attentions_match_eager(name):
    torch.manual_seed(0)
    model = MODELS[name][1]().eval()
    model.config._attn_implementation = "eager"  # attentions need the eager attention
    jitted = fulmen.jit(copy.deepcopy(model))
    ids, mask = _batch()
    for hidden, attentions in [(True, True), (False, False), (True, False), (True, True)]:
        kwargs = dict(input_ids=ids, attention_mask=mask, use_cache=False,
                      output_hidden_states=hidden, output_attentions=attentions)
        want, got = model(**kwargs), jitted(**kwargs)
        assert (got.hidden_states is not None, got.attentions is not None) == (hidden, attentions)
        assert len(_flat(got)) == len(_flat(want))
        torch.testing.assert_close(_flat(got), _flat(want))
    assert fulmen.compile_stats(jitted).eager_calls == 0


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_inputs_embeds_grad_logits_to_keep_and_tuples_match_eager(name):
    torch.manual_seed(0)
    model = MODELS[name][1]().train()
    jitted = fulmen.jit(copy.deepcopy(model))
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    embeds = model.get_input_embeddings()(ids).detach()
    grads = []
    for target in (model, jitted):
        leaf = embeds.clone().requires_grad_()
        out = target(inputs_embeds=leaf, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        grads.append((out.loss, out.logits, leaf.grad))
    torch.testing.assert_close(grads[1], grads[0])
    with torch.no_grad():
        for kwargs in (dict(logits_to_keep=1), dict(return_dict=False, labels=labels)):
            want = model(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs)
            got = jitted(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs)
            assert type(got) is type(want)
            torch.testing.assert_close(_flat(got), _flat(want))


def test_layerdrop_in_training_matches_eager_under_the_same_seed():
    # each path (layers skipped at random by `torch.rand([]) < layerdrop`) returns a cache with
    # its own layers: was refused ("a different kind of object after a graph break")
    config = transformers.OPTConfig(vocab_size=96, hidden_size=16, num_hidden_layers=3,
                                    ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16,
                                    max_position_embeddings=64, layerdrop=0.5, dropout=0.1)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(config).train()
    jitted = fulmen.jit(copy.deepcopy(model))
    ids, mask = _batch()
    for seed in range(6):
        results = []
        for target in (model, jitted):
            torch.manual_seed(seed)
            out = target(input_ids=ids, attention_mask=mask, labels=ids)
            grads = torch.autograd.grad(out.loss, list(target.parameters()), allow_unused=True)
            results.append((out.logits, [g for g in grads if g is not None]))
        torch.testing.assert_close(results[1], results[0])
    assert fulmen.compile_stats(jitted).eager_calls == 0
