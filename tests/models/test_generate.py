"""HF `generate()` with a jitted model (issue 16): `jm.generate` runs the jitted forward for the
prefill and every decoding step, with the default `DynamicCache` (its tensors grow by one
position per token: symbolic sizes) and with the static cache (preallocated buffers updated in
place with `index_copy_`). Tokens must equal eager's; compilations are counted per phase.

Tiny configs (one layer, random weights, no downloads) keep each case to a few seconds.
"""

import os

import pytest
import torch

import fulmen

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

VOCAB = 96


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                  max_position_embeddings=128)
    if name == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(**common))
    elif name == "qwen2":
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**common))
    else:
        model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB,
                                               n_positions=128, bos_token_id=0, eos_token_id=0))
    return model.eval()


def _count_compiles(jmodel) -> dict[str, int]:
    """Counts the compilations of `jmodel`'s forward by phase: `prefill` (more than one new
    token) and `decode` (one new token)."""
    counts = {"prefill": 0, "decode": 0}
    jitted = jmodel._jit
    compile_call = jitted._compile_call

    def counting(args, kwargs, leaves):
        ids = kwargs.get("input_ids", args[0] if args else None)
        counts["prefill" if ids.shape[-1] > 1 else "decode"] += 1
        return compile_call(args, kwargs, leaves)

    jitted._compile_call = counting
    return counts


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_greedy_generate_equals_eager(name, cache):
    model = _model(name)
    options = dict(max_new_tokens=12, do_sample=False)
    if cache == "static":
        options["cache_implementation"] = "static"
    jmodel = fulmen.jit(model)
    counts = _count_compiles(jmodel)
    for length in (6, 9):  # a second prompt length: the prefill goes symbolic, decode is reused
        ids = torch.randint(0, VOCAB, (1, length))
        want = model.generate(ids, **options)
        got = jmodel.generate(ids, **options)
        assert torch.equal(got, want)
    stats = fulmen.compile_stats(jmodel)
    assert stats.eager_calls == 0 and stats.calls == 2 * 12  # every step ran compiled code
    assert counts["prefill"] <= 2 and counts["decode"] <= 2, counts


def test_sampling_with_a_seed_equals_eager():
    model = _model("llama")
    jmodel = fulmen.jit(model)
    ids = torch.randint(0, VOCAB, (1, 5))
    options = dict(max_new_tokens=8, do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(3)
    want = model.generate(ids, **options)
    torch.manual_seed(3)
    got = jmodel.generate(ids, **options)
    assert torch.equal(got, want)
