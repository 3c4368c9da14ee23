"""HF models called the ways the other model tests do not call them: a decoding loop over a
`DynamicCache()` made without a config (layers appended as first used), a seq2seq loop feeding
`encoder_outputs` with an `EncoderDecoderCache`, the cache passed as `cache=` (transformers
5.24's name for `past_key_values`), sequences packed into one row by `position_ids`,
`generate` from `inputs_embeds`, without a cache, under `torch.inference_mode`, Whisper's
`generate` from `input_features`, beam search over a mixture of experts returning logits, and a
prompt prefilled in chunks past a sliding window.
Each answer equals eager's (tokens exactly, logits and scores to float32 rounding), and every
call runs the compiled forward (`eager_calls == 0`)."""

import copy
import os

import pytest
import torch

import fulmen

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

from tests.models.test_hf_generate_variants import _model, _prompt  # noqa: E402
from tests.models.test_hf_models import VOCAB  # noqa: E402

_LOGITS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


def _same(got, want) -> None:
    """Tensors equal (integers) or close to float32 rounding, through tuples and outputs."""
    if isinstance(want, torch.Tensor):
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want), (got.tolist(), want.tolist())
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _same(a, b)
    elif isinstance(want, T.EncoderDecoderCache):
        _same([got.self_attention_cache, got.cross_attention_cache],
              [want.self_attention_cache, want.cross_attention_cache])
    elif isinstance(want, T.Cache):
        assert type(got) is type(want)
        _same([(layer.keys, layer.values) for layer in got.layers],
              [(layer.keys, layer.values) for layer in want.layers])
    elif hasattr(want, "keys"):
        assert set(got.keys()) == set(want.keys())
        for key in want.keys():
            _same(got[key], want[key])
    else:
        assert got == want


def _compiled_every_call(jmodel, calls: int | None = None) -> None:
    stats = fulmen.compile_stats(jmodel)
    assert stats.eager_calls == 0 and stats.calls > 0, (stats.eager_calls, stats.calls)
    if calls is not None:
        assert stats.calls == calls


def _decoder_loop(call, model, cache_name: str):
    """Greedy decoding by hand into a cache made by the caller without a config."""
    ids, mask = _prompt()
    cache, logits = T.DynamicCache(), []
    with torch.no_grad():
        for _ in range(3):
            step = ids if not logits else ids[:, -1:]
            out = call(input_ids=step, attention_mask=mask, use_cache=True,
                       **{cache_name: cache})
            logits.append(out.logits)
            token = out.logits[:, -1:].argmax(-1)
            ids = torch.cat([ids, token], 1)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
    return ids, logits, [layer.keys for layer in cache.layers]


def _seq2seq_loop(call, model, cache_name: str):
    """Greedy decoding by hand: the encoder run once, its output fed to every decoder call
    with an `EncoderDecoderCache` of two config-less caches."""
    ids, mask = _prompt()
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=ids, attention_mask=mask)
        cache = T.EncoderDecoderCache(T.DynamicCache(), T.DynamicCache())
        decoded = torch.full((2, 1), model.config.decoder_start_token_id)
        logits = []
        for _ in range(3):
            out = call(encoder_outputs=encoded, attention_mask=mask,
                       decoder_input_ids=decoded[:, -1:], use_cache=True,
                       **{cache_name: cache})
            logits.append(out.logits)
            decoded = torch.cat([decoded, out.logits[:, -1:].argmax(-1)], 1)
    return decoded, logits


@pytest.mark.parametrize("name,cache_name", [("gpt2", "cache"), ("t5", "past_key_values")])
def test_a_cache_made_without_a_config_compiles_from_the_first_call(name, cache_name):
    """The first call appends the cache's layers (`DynamicCache()` knows none yet), each new
    layer holding a traced tensor: before, the check that the store can be rebuilt copied the
    new layers with their proxies, failed, and the call ran eagerly."""
    model = _model(name)
    loop = _seq2seq_loop if name == "t5" else _decoder_loop
    want = loop(model, model, cache_name)
    jmodel = fulmen.jit(copy.deepcopy(model))
    _same(loop(jmodel, model, cache_name), want)
    _compiled_every_call(jmodel, calls=3)


def _packed_step(call, model, positions):
    model.zero_grad(set_to_none=True)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    out = call(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    out.loss.backward()
    return [out.loss, out.logits, *(p.grad for p in model.parameters())]


def test_sequences_packed_by_position_ids_train_as_eager():
    """No attention mask: the positions restarting at 0 mark where each packed sequence
    begins, and the mask keeps them apart (`find_packed_sequence_indices`)."""
    model = _model("qwen3").train()
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]])
    want = _packed_step(model, model, packed)
    twin = copy.deepcopy(model)
    jtwin = fulmen.jit(twin)
    _same(_packed_step(jtwin, twin, packed), want)
    _compiled_every_call(jtwin, calls=1)
    unpacked = _packed_step(model, model, torch.arange(10).expand(2, 10))
    assert not torch.allclose(unpacked[1], want[1])  # the packing changes the answer


def _generate_both(model, **options):
    torch.manual_seed(11)
    want = model.generate(**options)
    jmodel = fulmen.jit(copy.deepcopy(model))
    torch.manual_seed(11)
    _same(jmodel.generate(**options), want)
    return jmodel


def test_generate_from_inputs_embeds_matches_eager():
    model = _model("llama")
    ids, mask = _prompt()
    embeds = model.get_input_embeddings()(ids).detach()
    jmodel = _generate_both(model, inputs_embeds=embeds, attention_mask=mask, max_new_tokens=4,
                            **_LOGITS)
    _compiled_every_call(jmodel, calls=4)


def test_generate_without_a_cache_matches_eager():
    """`use_cache=False`: every step runs the whole sequence, one token longer each time."""
    ids, mask = _prompt()
    jmodel = _generate_both(_model("gpt2"), input_ids=ids, attention_mask=mask, max_new_tokens=4,
                            use_cache=False, **_LOGITS)
    _compiled_every_call(jmodel, calls=4)


def test_generate_under_inference_mode_matches_eager():
    """The cache and every tensor made during the calls are inference tensors."""
    ids, mask = _prompt()
    with torch.inference_mode():
        jmodel = _generate_both(_model("gpt2"), input_ids=ids, attention_mask=mask,
                                max_new_tokens=4, **_LOGITS)
    _compiled_every_call(jmodel, calls=4)


def test_whisper_generates_from_input_features_as_eager():
    model = _model("whisper")
    features = torch.randn(2, model.config.num_mel_bins, 2 * model.config.max_source_positions,
                           generator=torch.Generator().manual_seed(4))
    jmodel = _generate_both(model, input_features=features, max_new_tokens=4, **_LOGITS)
    _compiled_every_call(jmodel)


def test_beam_search_over_experts_returns_eagers_logits_and_beams():
    """Qwen2-MoE: the experts each beam reaches decide the trace; sequences, scores, logits,
    beam indices and sequence scores as eager's."""
    ids, mask = _prompt()
    jmodel = _generate_both(_model("qwen2_moe"), input_ids=ids, attention_mask=mask,
                            max_new_tokens=3, num_beams=3, num_return_sequences=2,
                            early_stopping="never", **_LOGITS)
    _compiled_every_call(jmodel, calls=3)


def _chunked_prefill(call, model):
    """The prompt fed in chunks of 3 into a cache whose sliding window (4) is shorter than
    it, then two decoding steps: each chunk attends across the window's edge."""
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    cache, logits = T.DynamicCache(config=model.config), []
    with torch.no_grad():
        for start in (0, 3, 6, 8, 9):
            step = ids[:, start:start + 3] if start < 8 else ids[:, -1:]
            out = call(input_ids=step, past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(start, start + step.shape[1]))
            logits.append(out.logits)
            if start >= 6:
                ids = torch.cat([ids, out.logits[:, -1:].argmax(-1)], 1)
    return ids, logits


def test_chunked_prefill_past_a_sliding_window_matches_eager():
    model = _model("gemma3")
    want = _chunked_prefill(model, model)
    jmodel = fulmen.jit(copy.deepcopy(model))
    _same(_chunked_prefill(jmodel, model), want)
    _compiled_every_call(jmodel, calls=5)
