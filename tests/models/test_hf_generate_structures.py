"""HF `generate()` calls of several structures through one jitted model: prefill and decoding,
without and with padding, a sliding-window cache before and after it fills. Each structure needs
entries of its own; `cache_size_limit` counts per structure (NOTE [cache limits per call
structure] in `fulmen/cache_policy.py`), so a new batch size after a few prompt lengths stays
compiled."""

import os

import pytest
import torch

import fulmen

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from tests.models.test_hf_models import MODELS, VOCAB  # noqa: E402


def test_generate_unpadded_then_padded_at_a_new_batch_stays_compiled():
    """Mistral (window 4), a prompt of 5 unpadded, then a left-padded batch of 2: the unpadded
    prefill, its decoding (two entries: the first step, the later ones), the padded prefill and
    its decoding. With `cache_size_limit=3` over all entries (before) the fourth compilation
    and every call after it ran eagerly; per structure, none does."""
    torch.manual_seed(0)
    model = MODELS["mistral"][1]().eval()
    jmodel = fulmen.jit(model, cache_size_limit=3)
    for batch, length in ((1, 5), (2, 6)):
        ids = torch.randint(3, VOCAB, (batch, length))
        mask = torch.ones_like(ids)
        mask[-1, :2] = 0 if batch > 1 else 1
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                      pad_token_id=0)
        got, want = jmodel.generate(**kwargs), model.generate(**kwargs)
        assert torch.equal(got, want), f"{batch}x{length}: {got.tolist()} {want.tolist()}"
    stats = fulmen.compile_stats(jmodel)
    assert stats.calls == 8 and stats.eager_calls == 0, stats.recompile_reasons
    assert stats.cache_misses <= 6, stats.recompile_reasons
