"""HF `generate()` options users combine, through a jitted model and eagerly: beam search
(length penalty, early stopping, several returned sequences, the static cache), sampling with
top-k/top-p/temperature under a seed, repetition penalties, `min_new_tokens` against an eos,
scores returned with the tokens, classifier-free guidance, a generation continued from the cache
it returned, and a training step between two generations. Tokens equal eager's, scores agree,
every call compiled (none eager) with few compilations."""

import copy
import os

import pytest
import torch

import fulmen

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from tests.models.test_hf_models import MODELS, VOCAB  # noqa: E402

_SCORES = dict(return_dict_in_generate=True, output_scores=True)


def _model(name: str):
    torch.manual_seed(0)
    model = MODELS[name][1]().eval()
    model.generation_config.pad_token_id = 0
    return model


def _prompt():
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    return ids, mask


def _generate(model, **options):
    ids, mask = _prompt()
    torch.manual_seed(11)
    return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, **options)


def _same_output(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), (got.tolist(), want.tolist())
        return
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):  # -inf where a processor masked a token
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if getattr(want, "sequences_scores", None) is not None:
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores)


def _eos(model) -> int:
    """A token greedy decoding emits at its third step for the first row."""
    return int(_generate(model, max_new_tokens=3, do_sample=False)[0, -1])


_VARIANTS = {
    "beam_length_penalty": ("llama", dict(max_new_tokens=6, num_beams=3, length_penalty=0.7,
                                          early_stopping=True, num_return_sequences=2,
                                          **_SCORES)),
    "beam_static_sliding": ("mistral", dict(max_new_tokens=6, num_beams=3,
                                            cache_implementation="static", **_SCORES)),
    "sample_top_k_top_p": ("qwen2", dict(max_new_tokens=8, do_sample=True, top_k=10, top_p=0.9,
                                         temperature=0.7, **_SCORES)),
    "repetition_no_repeat": ("phi3", dict(max_new_tokens=10, repetition_penalty=1.5,
                                          no_repeat_ngram_size=2, do_sample=False, **_SCORES)),
    "min_new_tokens_eos": ("gemma3", dict(max_new_tokens=10, min_new_tokens=5, do_sample=False,
                                          **_SCORES)),
}


@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_generate_options_match_eager(variant):
    name, options = _VARIANTS[variant]
    model = _model(name)
    if variant == "min_new_tokens_eos":
        options = {**options, "eos_token_id": _eos(model)}
    want = _generate(model, **options)
    jmodel = fulmen.jit(copy.deepcopy(model))
    _same_output(_generate(jmodel, **options), want)
    stats = fulmen.compile_stats(jmodel)
    assert stats.eager_calls == 0 and stats.cache_misses <= 3, stats.recompile_reasons


@pytest.mark.parametrize("name", ["gemma2", "gpt2"])
def test_classifier_free_guidance_compiles_a_few_times(name):
    """`guidance_scale` with a negative prompt: the unconditional model call alternates with
    the decoding step, without `position_ids` and on `input_ids[:, -1:]` (a (1, 1) view whose row
    stride grows each step), with a cache of its own whose counter sits at another argument
    position. Both the view's strides and the counter go symbolic; before, every step compiled
    (Gemma2: 12 compiles, then calls past `cache_size_limit` ran eagerly)."""
    model = _model(name)
    ids, mask = _prompt()
    options = dict(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=6,
                   do_sample=False, guidance_scale=1.5, negative_prompt_ids=ids[:1, :4],
                   pad_token_id=0, eos_token_id=None)
    want = model.generate(**options)
    jmodel = fulmen.jit(copy.deepcopy(model))
    _same_output(jmodel.generate(**options), want)
    stats = fulmen.compile_stats(jmodel)
    assert stats.calls == 12  # 6 steps, each with its unconditional call
    assert stats.eager_calls == 0 and stats.cache_misses <= 6, stats.recompile_reasons


def _continued(model) -> list[torch.Tensor]:
    """Generate, append two tokens, and generate on from the cache the first call returned."""
    first = _generate(model, max_new_tokens=4, do_sample=False, **_SCORES)
    ids = torch.cat([first.sequences, torch.full((2, 2), 7)], dim=1)
    _, mask = _prompt()
    mask = torch.cat([mask, torch.ones(2, ids.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    again = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                           do_sample=False, pad_token_id=0, past_key_values=first.past_key_values)
    return [first.sequences, again]


def test_generation_continued_from_its_returned_cache_matches_eager():
    model = _model("llama")
    want = _continued(model)
    jmodel = fulmen.jit(copy.deepcopy(model))
    for got, expected in zip(_continued(jmodel), want):
        assert torch.equal(got, expected)
    assert fulmen.compile_stats(jmodel).eager_calls == 0


def _train_then_generate(model, call) -> list[torch.Tensor]:
    """A training step (GPT-2's dropout on), generation, a second step, generation again."""
    ids, mask = _prompt()
    results = []
    for _ in range(2):
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        out = call(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        results.append(torch.cat([p.grad.flatten() for p in model.parameters()
                                  if p.grad is not None]))
        model.eval()
        results.append(_generate(call, max_new_tokens=5, do_sample=False))
    return results


def test_training_steps_between_generations_match_eager():
    model = _model("gpt2")
    twin = copy.deepcopy(model)
    want = _train_then_generate(model, model)
    jtwin = fulmen.jit(twin)
    got = _train_then_generate(twin, jtwin)
    for i, (a, b) in enumerate(zip(got, want)):
        if i % 2:
            assert torch.equal(a, b), i
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    stats = fulmen.compile_stats(jtwin)
    assert stats.eager_calls == 0 and stats.cache_misses <= 4, stats.recompile_reasons


def _hand_written_loop(model, config, kind: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding as users write it: the cache made by hand, `generated[:, -1:]` fed in."""
    from transformers import DynamicCache, StaticCache

    generated = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    cache = StaticCache(config=config, max_cache_len=32) if kind == "static" \
        else DynamicCache(config=config)
    logits = []
    with torch.no_grad():
        out = model(input_ids=generated, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(6))
        for _ in range(8):
            generated = torch.cat([generated, out.logits[:, -1:].argmax(-1)], dim=1)
            out = model(input_ids=generated[:, -1:], past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([generated.shape[1] - 1]))
            logits.append(out.logits)
    return generated, logits


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_hand_written_decoding_loop_compiles_three_times(kind):
    """The last token is a (1, 1)-per-row view of the growing `generated`, its row stride new at
    every step: traced with free strides once they vary (before: 9 compiles, then eager)."""
    model = _model("llama")
    want, want_logits = _hand_written_loop(model, model.config, kind)
    jmodel = fulmen.jit(copy.deepcopy(model))
    got, got_logits = _hand_written_loop(jmodel, model.config, kind)
    assert torch.equal(got, want)
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b)
    stats = fulmen.compile_stats(jmodel)
    assert stats.eager_calls == 0 and stats.cache_misses <= 3, stats.recompile_reasons


def test_encoder_decoder_guidance_without_negative_prompt_matches_eager():
    """BART with `guidance_scale` and no negative prompt: the unconditional call passes the last
    token as `input_ids` with an attention mask one longer each step, so the encoder's
    bidirectional mask is as wide as the mask, not the keys. Eager drops the all-ones mask
    after reading its values; the traced path (`is_tracing` answered True for proxies, NOTE
    [traced-tensor answers]) built it and SDPA refused the widths. The call is traced again
    without the library answers, reading the mask's values (a graph break) as eager does."""
    model = _model("bart")
    ids, mask = _prompt()
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True,
                   guidance_scale=1.5, pad_token_id=0)
    torch.manual_seed(5)
    want = model.generate(**options)
    jmodel = fulmen.jit(copy.deepcopy(model))
    torch.manual_seed(5)
    _same_output(jmodel.generate(**options), want)
    assert fulmen.compile_stats(jmodel).eager_calls == 0
