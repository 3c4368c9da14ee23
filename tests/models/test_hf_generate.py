"""HF `generate()` through a jitted model, called as users call it: a left-padded batch,
greedy and sampling with a fixed seed; the tokens equal eager's.

Padding is where it goes wrong quietly: `generate` reads the forward's signature to decide what
to pass (GPT-2 and OPT get `position_ids` computed from the padded mask only if their forward
takes them), so a jitted forward that hid its signature decoded the padded row as if unpadded.
"""

import os

import pytest
import torch

import fulmen

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from tests.models.test_hf_models import MODELS, VOCAB  # noqa: E402


def _padded_prompt():
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


@pytest.mark.parametrize("name,sample", [("gpt2", False), ("gpt2", True), ("opt", False),
                                         ("llama", False), ("gemma2", False)])
def test_generate_with_left_padding_matches_eager(name, sample):
    torch.manual_seed(0)
    model = MODELS[name][1]().eval()
    ids, mask = _padded_prompt()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=sample,
                  pad_token_id=0)
    torch.manual_seed(1)
    want = model.generate(**kwargs)
    jmodel = fulmen.jit(model)
    torch.manual_seed(1)
    got = jmodel.generate(**kwargs)
    assert torch.equal(got, want), f"{name}: fulmen {got.tolist()} eager {want.tolist()}"
    stats = fulmen.compile_stats(jmodel)
    assert stats.calls == 10  # prefill + 9 decode steps, all through the jitted forward
    assert stats.eager_calls == 0 and stats.cache_misses <= 4


@pytest.mark.parametrize("name,beams", [("t5", 1), ("bart", 2)])
def test_encoder_decoder_generate_matches_eager(name, beams):
    """`generate` passes the encoder's output (a ModelOutput, which refuses `update`) into every
    decoder call; tracing must leave it as it was."""
    torch.manual_seed(0)
    model = MODELS[name][1]().eval()
    ids, mask = _padded_prompt()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=beams,
                  do_sample=False)
    want = model.generate(**kwargs)
    got = fulmen.jit(model).generate(**kwargs)
    assert torch.equal(got, want), f"{name}: fulmen {got.tolist()} eager {want.tolist()}"


@pytest.mark.parametrize("name,cache", [("gemma2", "dynamic"), ("gemma3", "dynamic"),
                                        ("llama4", "dynamic"), ("gemma2", "static"),
                                        ("gemma4", "dynamic")])
def test_decode_compiles_at_most_twice(name, cache):
    """Greedy decoding of 16 tokens: prefill and decode compile at most twice each, with the
    tokens of eager (the static cache's sliding-window layers count in `cumulative_length_int`)."""
    torch.manual_seed(0)
    model = MODELS[name][1]().eval()
    ids, mask = _padded_prompt()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                  pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    _greedy_tokens_as_eager(name, model, kwargs, max_misses=4)



def _greedy_tokens_as_eager(name, model, kwargs, max_misses: int) -> None:
    """`generate(**kwargs)` through the jitted model gives eager's tokens, every call compiled
    (none eager) with at most `max_misses` compiles."""
    want = model.generate(**kwargs)
    jmodel = fulmen.jit(model)
    got = jmodel.generate(**kwargs)
    assert torch.equal(got, want), f"{name}: fulmen {got.tolist()} eager {want.tolist()}"
    stats = fulmen.compile_stats(jmodel)
    assert stats.eager_calls == 0 and stats.cache_misses <= max_misses, stats.recompile_reasons


def _draft_and_crop(call, model, steps: int) -> list[int]:
    """Greedy decoding as assisted generation runs it: each step verifies the next token and
    two drafted ones, then crops the rejected two from the cache (`DynamicCache.crop`)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.arange(6).view(1, 6) * 7 % VOCAB
    tokens = []
    with torch.no_grad():
        logits = call(ids, past_key_values=cache, use_cache=True).logits
        for _ in range(steps):
            token = logits[:, -1:].argmax(-1)
            draft = torch.cat([token, (token + 1) % VOCAB, (token + 2) % VOCAB], dim=1)
            logits = call(draft, past_key_values=cache, use_cache=True).logits[:, :1]
            cache.crop(-2)
            tokens.append(int(token))
    return tokens


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_cropped_cache_does_not_compile_per_token(name):
    """A cropped cache holds views (`keys[..., :n, :]`, strides from the longer cache): they
    get symbolic sizes and strides (NOTE [strides of a view input]), so decoding with a cache
    cropped at every step compiles a bounded number of times, not once per token."""
    torch.manual_seed(0)
    model = MODELS[name][1]().eval()
    want = _draft_and_crop(model, model, 10)
    jmodel = fulmen.jit(model)
    got = _draft_and_crop(jmodel, model, 10)
    assert got == want
    stats = fulmen.compile_stats(jmodel)
    assert stats.eager_calls == 0 and stats.cache_misses <= 4, stats.recompile_reasons


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_prompt_lookup_decoding_compiles_a_bounded_number_of_times(name):
    """Assisted generation (`prompt_lookup_num_tokens`) crops the cache only at the steps that
    reject drafted tokens, so the cache arrives contiguous at some calls and as a view at
    others: a cache seen as a view is traced with strides free of its length (NOTE [strides of
    a view input]), and one entry serves both layouts. Prefill, the first decode step, decode
    and verification compile once each (6 before: each layout of decode and verification
    compiled apart), with eager's tokens."""
    torch.manual_seed(0)
    model = MODELS[name][1]().eval()
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (1, 6)).repeat(1, 3)  # repeats: drafts from the prompt
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                  do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=3)
    _greedy_tokens_as_eager(name, model, kwargs, max_misses=4)


def test_decoding_across_the_sliding_window_matches_eager():
    """A short prompt (2) decoded past Gemma2's sliding window (4; its other layer attends to
    all): the sliding layer's cache grows, then holds its last `window - 1` positions as a view
    of each step's `cat`, with eager's tokens and every call compiled. HF's sliding-window code
    branches where the cache fills (`kv_length >= local_attention_size` in `masking_utils.
    _ignore_causal_mask_sdpa`; `is_full` and `max()` in `DynamicSlidingWindowLayer.
    get_mask_sizes`; the `[-window + 1:]` slice clamping in its `update`), so decoding compiles
    once per side of each branch: the first step, the step at `cumulative_length == window -
    1`, the steps past it; 4 with the prefill. torch.compile makes as many graphs of such a
    `generate` (session 50: 4 at window 8 and prompt 6, 6 at prompt 3, as fulmen)."""
    torch.manual_seed(0)
    model = MODELS["gemma2"][1]().eval()
    assert model.config.sliding_window == 4
    ids = torch.randint(3, VOCAB, (1, 2))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                  do_sample=False, pad_token_id=0)
    _greedy_tokens_as_eager("gemma2", model, kwargs, max_misses=4)


def test_prompts_longer_than_the_sliding_window_share_the_decoding_entries():
    """After a prefill longer than Mistral's window (4) the sliding layer's keys are a view at
    offset `(prompt - 3) * row`, at every later step at one row: the offset, guarded as a
    constant inside the cache object, made each prompt length compile its first decoding step
    anew (7 compiles for 4 prompt lengths, one more per length up to the cache size limit).
    It is guarded only where read (NOTE [offsets of held tensors]): 4, with eager's tokens."""
    torch.manual_seed(0)
    model = MODELS["mistral"][1]().eval()
    jmodel = fulmen.jit(model)
    for length in (5, 6, 7, 9):
        ids = torch.randint(3, VOCAB, (1, length))
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                      do_sample=False, pad_token_id=0)
        got, want = jmodel.generate(**kwargs), model.generate(**kwargs)
        assert torch.equal(got, want), f"{length}: fulmen {got.tolist()} eager {want.tolist()}"
    stats = fulmen.compile_stats(jmodel)
    assert stats.calls == 16 and stats.eager_calls == 0, stats
    assert stats.cache_misses <= 4, stats.recompile_reasons
