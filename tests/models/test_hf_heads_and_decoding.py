"""HF task heads and decoding loops as users run them, jitted and compared with eager.

Heads: sequence classification on right-padded batches (the head finds each row's last real
token from `pad_token_id`; single-label, regression and multi-label losses chosen from the
labels), token classification with `-100` labels, question answering with an answer position
past the end (clamped and ignored). Decoding: assisted generation (a jitted draft model whose
cache is cropped after rejected tokens), prompt-lookup decoding, and a `DynamicCache` the caller
keeps, crops and feeds back.
"""

import copy
import os
import warnings

import pytest
import torch

import fulmen

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

VOCAB = 96
_SIZES = {
    "llama": ("Llama", dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, head_dim=8)),
    "gpt2": ("GPT2", dict(n_layer=2, n_embd=32, n_head=4, n_positions=64)),
}


def _model(arch: str, head: str, seed: int = 0, **config):
    prefix, sizes = _SIZES[arch]
    torch.manual_seed(seed)
    cfg = getattr(T, f"{prefix}Config")(**{**sizes, "vocab_size": VOCAB, "pad_token_id": 0, **config})
    return getattr(T, f"{prefix}{head}")(cfg)


def _right_padded():
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(5))
    ids[0, 6:] = 0
    return ids, (ids != 0).long()


_HEADS = {
    "single": ("ForSequenceClassification", dict(num_labels=3),
               lambda ids, mask: dict(labels=torch.tensor([1, 0, 2]))),
    "regression": ("ForSequenceClassification", dict(num_labels=1),
                   lambda ids, mask: dict(labels=torch.tensor([0.5, -1.0, 2.0]))),
    "multi_label": ("ForSequenceClassification",
                    dict(num_labels=3, problem_type="multi_label_classification"),
                    lambda ids, mask: dict(labels=(ids[:, :3] % 2).float())),
    "token": ("ForTokenClassification", dict(num_labels=3),
              lambda ids, mask: dict(labels=torch.where(mask.bool(), ids % 3, -100))),
    "qa": ("ForQuestionAnswering", {},
           lambda ids, mask: dict(start_positions=torch.tensor([1, 2, 30]),
                                  end_positions=torch.tensor([3, 5, 4]))),
}


def _head_step(model, call, batch):
    out = call(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    logits = out.logits if hasattr(out, "logits") else torch.stack(
        [out.start_logits, out.end_logits])
    return out.loss.detach(), logits.detach(), grads


@pytest.mark.parametrize("arch,task", [("llama", task) for task in _HEADS]
                         + [("gpt2", "single"), ("gpt2", "qa")])
def test_task_head_on_padded_batch_matches_eager(arch, task):
    head, config, labels = _HEADS[task]
    model = _model(arch, head, **config).train()
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(twin)
    ids, mask = _right_padded()
    batch = dict(input_ids=ids, attention_mask=mask, **labels(ids, mask))
    for _ in range(2):  # the second call hits the cache
        torch.manual_seed(1)  # the same dropout masks
        want = _head_step(model, model, batch)
        torch.manual_seed(1)
        got = _head_step(twin, jitted, batch)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    model.eval(), twin.eval()
    with torch.no_grad():
        del batch["attention_mask"]  # the head finds the last real token from pad_token_id
        for key in [k for k in batch if k != "input_ids"]:
            del batch[key]
        want, got = model(**batch, use_cache=False), jitted(**batch, use_cache=False)
        torch.testing.assert_close(got.to_tuple(), want.to_tuple())


def test_assisted_generation_with_a_jitted_draft_matches_eager():
    """The draft's cache is cropped after every rejected token, outside the compiled calls."""
    target, draft = _model("llama", "ForCausalLM").eval(), _model(
        "llama", "ForCausalLM", seed=7, num_hidden_layers=1).eval()
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    kwargs = dict(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    want = target.generate(**kwargs, assistant_model=draft)
    got = fulmen.jit(target).generate(**kwargs, assistant_model=fulmen.jit(draft))
    assert torch.equal(got, want), f"fulmen {got.tolist()} eager {want.tolist()}"


def test_prompt_lookup_decoding_matches_eager():
    model = _model("gpt2", "LMHeadModel").eval()
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9, 5, 6]])
    kwargs = dict(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                  prompt_lookup_num_tokens=3)
    want = model.generate(**kwargs)
    got = fulmen.jit(model).generate(**kwargs)
    assert torch.equal(got, want), f"fulmen {got.tolist()} eager {want.tolist()}"


def test_a_cache_the_caller_crops_and_feeds_back():
    model = _model("llama", "ForCausalLM").eval()
    jitted = fulmen.jit(copy.deepcopy(model))
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    results = []
    for call in (model, jitted):
        cache = T.DynamicCache(config=model.config)
        logits = [call(input_ids=ids, past_key_values=cache, use_cache=True).logits]
        cache.crop(-4)  # drop the last 4 positions
        logits.append(call(input_ids=ids[:, 5:7], past_key_values=cache, use_cache=True).logits)
        logits.append(call(input_ids=ids[:, 7:8], past_key_values=cache, use_cache=True).logits)
        results.append((logits, cache.get_seq_length(), cache.layers[0].keys.clone()))
    (want, want_len, want_keys), (got, got_len, got_keys) = results
    assert got_len == want_len == 8
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_keys, want_keys)


def test_a_cache_built_under_grad_mode_reads_no_non_leaf_grad():
    """A `DynamicCache` filled under grad mode holds non-leaf tensors: walking it must not read
    their `.grad` (PyTorch warns on every such read)."""
    model = _model("llama", "ForCausalLM").eval()
    jitted = fulmen.jit(model)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    cache = T.DynamicCache(config=model.config)
    jitted(input_ids=ids, past_key_values=cache, use_cache=True)
    assert cache.layers[0].keys.grad_fn is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        jitted(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
