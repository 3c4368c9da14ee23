"""transformers 5.24 renames the forward's `past_key_values` to `cache` (the old name still
works, with a deprecation warning): a jitted model called with either spelling, by a hand-written
decoding loop or by `generate` with a cache the user made, decodes eager's tokens with every call
compiled, at most 2 compiles for the prefill and 2 for decoding."""

import os

import pytest
import torch

import fulmen

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

from tests.models.test_hf_models import MODELS, VOCAB  # noqa: E402


def _cache(model, kind: str):
    if kind == "static":
        return T.StaticCache(config=model.config, max_cache_len=24)
    return T.DynamicCache(config=model.config)


def _decode(call, model, spelling: str, kind: str, steps: int = 6) -> list[int]:
    cache = _cache(model, kind)
    ids = torch.arange(6).view(1, 6) * 7 % VOCAB
    tokens = []
    with torch.no_grad():
        logits = call(ids, **{spelling: cache}, use_cache=True).logits
        for _ in range(steps):
            token = logits[:, -1:].argmax(-1)
            tokens.append(int(token))
            logits = call(token, **{spelling: cache}, use_cache=True).logits
    return tokens


@pytest.mark.parametrize("spelling", ["cache", "past_key_values"])
@pytest.mark.parametrize("kind", ["dynamic", pytest.param("static", marks=pytest.mark.slow)])
def test_a_decoding_loop_passing_the_cache_by_either_name_matches_eager(spelling, kind):
    torch.manual_seed(0)
    model = MODELS["llama"][1]().eval()
    want = _decode(model, model, spelling, kind)
    jmodel = fulmen.jit(model)
    assert _decode(jmodel, model, spelling, kind) == want
    stats = fulmen.compile_stats(jmodel)
    assert stats.calls == 7 and stats.eager_calls == 0, stats
    assert stats.cache_misses <= 3, stats.recompile_reasons  # prefill, first step, the rest


@pytest.mark.parametrize("kind", [pytest.param("dynamic", marks=pytest.mark.slow), "static"])
def test_generate_with_a_cache_given_as_cache_matches_eager(kind):
    torch.manual_seed(0)
    model = MODELS["qwen2"][1]().eval()
    ids = torch.randint(3, VOCAB, (1, 5))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                  do_sample=False, pad_token_id=0)
    want = model.generate(**kwargs, cache=_cache(model, kind))
    jmodel = fulmen.jit(model)
    got = jmodel.generate(**kwargs, cache=_cache(model, kind))
    assert torch.equal(got, want), f"fulmen {got.tolist()} eager {want.tolist()}"
    stats = fulmen.compile_stats(jmodel)
    assert stats.calls == 8 and stats.eager_calls == 0, stats
    assert stats.cache_misses <= 3, stats.recompile_reasons
