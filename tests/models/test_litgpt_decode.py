"""litgpt models decoding with their own KV cache (`set_kv_cache`, `input_pos`), as litgpt's
`generate` drives them: the cache buffers are updated in place at each position, and the
logits of every step equal eager's; the decode steps share one symbolic compilation."""

import copy

import pytest
import torch

import fulmen

litgpt_model = pytest.importorskip("litgpt.model")
litgpt_config = pytest.importorskip("litgpt.config")


@pytest.mark.parametrize("name", ["pythia-14m", "Llama-3.2-1B", "Mixtral-8x7B-v0.1"])
def test_kv_cache_decoding_matches_eager(name):
    base = litgpt_config.Config.from_name(name)
    overrides = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=96, padded_vocab_size=96,
                     block_size=64, intermediate_size=128)
    if base.n_query_groups != base.n_head:
        overrides["n_query_groups"] = 2
    if getattr(base, "n_expert", 0):
        overrides.update(n_expert=4, n_expert_per_token=2, moe_intermediate_size=64)
    torch.manual_seed(0)
    model = litgpt_model.GPT(litgpt_config.Config.from_name(name, **overrides)).eval()
    twin = copy.deepcopy(model)
    for m in (model, twin):
        m.set_kv_cache(batch_size=1, max_seq_length=32)
    jtwin = fulmen.jit(twin)
    with torch.no_grad():
        prompt = torch.randint(0, 96, (1, 5))
        want, got = model(prompt, input_pos=torch.arange(5)), jtwin(prompt, input_pos=torch.arange(5))
        torch.testing.assert_close(got, want)
        for position in range(5, 10):
            token = want[:, -1:].argmax(-1)
            pos = torch.tensor([position])
            want, got = model(token, input_pos=pos), jtwin(token, input_pos=pos)
            torch.testing.assert_close(got, want)
    for a, b in zip(model.buffers(), twin.buffers()):
        torch.testing.assert_close(b, a)  # the caches themselves
    stats = fulmen.compile_stats(jtwin)
    assert stats.cache_misses <= 2 and stats.eager_calls == 0
