"""HF types the sweep skipped because their tiny config was refused or their inputs were unknown
(session 52): the facts the tiny configs now carry (`tests/sweeps/tiny_config.py`:
CHECKPOINT_FACTS, DEFAULT_FIXES, the MLA head-size rule) and the inputs the sweep now builds (a
draft model's drafting loop, a codebook decoder's ids), each checked against what transformers
needs to build and run the model."""

import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from tests.sweeps.hf_sweep import Case  # noqa: E402
from tests.sweeps.tiny_config import HIDDEN, tiny_config  # noqa: E402


def test_dbrx_attention_config_carries_rope_theta_and_clip():
    attn = tiny_config("dbrx").attn_config  # raised: the default had no rope_theta
    assert attn.rope_theta == 10000.0 and attn.clip_qkv == 8.0


def test_dory_layer_sections_add_up():
    config = tiny_config("dory")  # raised: the three section counts did not add up
    assert (config.n_input_layers, config.n_recurrent_layers, config.n_output_layers) == (1, 1, 1)
    assert config.num_hidden_layers == 3
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]


def test_dots3_note_adapters_hand_the_text_model_its_width():
    config = tiny_config("dots3_note")  # raised: adapter width 5120 against the tiny text width
    assert config.vision_config.adapter_out_dim == config.text_config.hidden_size == HIDDEN
    assert config.audio_config.adapter_out_dim == HIDDEN


def test_zamba_keeps_two_hybrid_layers():
    config = tiny_config("zamba")  # its model raised: one hybrid layer, nothing to tie
    assert config.layers_block_type.count("hybrid") == 2


def test_xlstm_head_widths_agree_between_cache_and_layers():
    config = tiny_config("xlstm")  # its cache's heads (rounded to 64) and layers' differed
    assert config.qk_dim == int(config.hidden_size * config.qk_dim_factor) == 64
    assert config.v_dim == int(config.hidden_size * config.v_dim_factor) == 64
    assert config.num_blocks == config.num_hidden_layers == 2


def test_gemma4_assistant_text_config_has_no_per_layer_inputs():
    text = tiny_config("gemma4_assistant").text_config  # the default failed its own validator
    assert text.hidden_size_per_layer_input == 0 and text.vocab_size_per_layer_input == 0
    assert text.num_kv_shared_layers == text.num_hidden_layers


def test_mla_head_size_stays_the_sum_of_its_parts():
    config = tiny_config("mistral4")  # head_dim 8 against 8 + 8: its forward failed eagerly
    assert config.head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim == 16


def test_token_ids_and_heads_of_esm_neomme_musicgen():
    esm = tiny_config("esm")  # no pad id: its embedding raised on input_ids.ne(None)
    assert (esm.pad_token_id, esm.mask_token_id) == (1, 32)
    neomme = tiny_config("neomme")  # a quarter of an 8-wide head: 2 rotated, not a multiple of 4
    assert neomme.head_dim == 16
    decoder = tiny_config("musicgen").decoder  # generate raised on a None start id
    assert decoder.decoder_start_token_id == decoder.pad_token_id < decoder.vocab_size


def test_segmentation_heads_get_the_features_they_read():
    beit = tiny_config("beit")  # raised: four out_indices needed, two layers kept
    assert beit.out_indices == [1, 2, 3, 4] and beit.num_hidden_layers == 4
    assert tiny_config("cvt").depth == [1, 2, 3]  # stage s read entry s of depth[s] rates
    upernet = tiny_config("upernet")  # its auxiliary head indexed a third stage of one
    assert len(upernet.backbone_config.out_features) == 4
    head = tiny_config("sapiens2").head_config  # its head read None upsampling channels
    assert head.upsample_out_channels == [16, 16] and head.conv_out_channels == [16]
    assert tiny_config("sapiens2").num_key_value_heads_per_layer == [4, 2]  # 16, 8 of 4 heads


def test_codebook_rows_of_a_codebook_decoder():
    stub = SimpleNamespace(codebooks=4, vocab=128, pad=0)
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    codes = Case._codes(stub, ids)
    assert codes.shape == (8, 3)  # (batch * codebooks, length), as MusicGen reshapes them
    rows = codes.view(2, 4, 3)
    assert torch.equal(rows[:, 0], ids)  # the first codebook is the row itself
    assert bool((rows[1, :, 0] == 0).all())  # padding stays padding in every codebook
    assert len({tuple(r.tolist()) for r in rows[0]}) == 4  # the codebooks differ


class _StateCache:
    """A cache as xLSTM's keeps its recurrent state: a dict of per-layer tuples of tensors."""

    def __init__(self):
        self.rnn_state = {0: (torch.randn(2, 3), torch.randn(2, 1))}


def _step(x, cache):
    state = cache.rnn_state[0]
    y = x * state[0] + state[1]
    state[0].copy_(y)  # the state updated in place, as xLSTM's blocks do
    return y.tanh()


def test_tensors_in_a_tuple_of_an_object_argument_are_read_on_every_call():
    # xlstm WRONG in the sweep (sampled generate after greedy): the tensors of a tuple held by an
    # object argument were captured while tracing, so a later call with another cache object
    # read (and updated) the first call's state
    import copy

    import fulmen

    jf = fulmen.jit(_step)
    torch.manual_seed(0)
    for _ in range(3):
        cache, x = _StateCache(), torch.randn(2, 3)
        twin = copy.deepcopy(cache)
        want, got = _step(x, cache), jf(x, twin)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(twin.rnn_state[0][0], cache.rnn_state[0][0])
    stats = fulmen.compile_stats(jf)
    assert stats.cache_misses == 1 and stats.eager_calls == 0


@pytest.mark.slow
def test_gemma4_assistant_drafting_loop_compiles_and_matches_eager():
    import fulmen
    from tests.sweeps.hf_assistant import AssistantCase, takes_shared_kv
    from tests.sweeps.hf_sweep import _check
    from tests.sweeps.tiny_config import config_for, model_class

    cls = model_class("Gemma4AssistantForCausalLM")
    config = config_for(cls, tiny_config("gemma4_assistant"))
    torch.manual_seed(0)
    model = cls(config)
    assert takes_shared_kv(model)
    case = AssistantCase(model, config)
    for name, make in case.checks():
        assert _check(name, make) == ("ok", "")
    stats = fulmen.compile_stats(case.jitted)
    assert stats.cache_misses == 2 and stats.eager_calls == 0
