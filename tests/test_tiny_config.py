"""The sweep's tiny-config builder (`tests/sweeps/tiny_config.py`): the generic shrinking rules
keep a config's per-layer facts consistent with each other (pure dicts, no model is built)."""

from tests.sweeps.tiny_config import HEAD_DIM, HIDDEN, _shrink


def test_layers_are_kept_by_kind_across_lists_index_lists_and_layer_indexed_dicts():
    default = {
        "hidden_size": 1024, "num_hidden_layers": 6,
        "layer_types": ["sliding", "sliding", "full", "sliding", "sliding", "full"],
        "moe_layers": [1, 2, 3, 5],  # layer indices, not one entry per layer
        "per_layer_config": {"02": {"head_dim": 512}, "05": {"head_dim": 512}},
        "id2label": {0: "LABEL_0", 1: "LABEL_1"},  # keyed by small ints, not layers
    }
    tiny = _shrink(default, {})
    # layer 0 (sliding, dense), 1 (sliding, moe), 2 (full, moe, wide heads): one of each kind
    assert tiny["num_hidden_layers"] == 3
    assert tiny["layer_types"] == ["sliding", "sliding", "full"]
    assert tiny["moe_layers"] == [1, 2]
    assert tiny["per_layer_config"] == {"02": {"head_dim": HEAD_DIM}}  # shrunk too
    assert tiny["id2label"] == default["id2label"]
    assert tiny["hidden_size"] == HIDDEN


def test_sizes_the_model_needs_are_filled_and_other_nones_stay():
    default = {"hidden_size": 4096, "num_attention_heads": 32, "head_dim": None,
               "num_key_value_heads": None, "q_lora_rank": None,
               "attention_hidden_size": 8192, "unpadded_vocab_size": 200058}
    tiny = _shrink(default, {})
    assert tiny["head_dim"] == HEAD_DIM and tiny["num_key_value_heads"] == 4
    assert tiny["q_lora_rank"] is None  # None means "no low-rank query" there
    assert tiny["attention_hidden_size"] == 2 * HIDDEN  # twice the hidden size, as before
    assert tiny["unpadded_vocab_size"] == 128


def test_mamba2_heads_still_span_expand_times_hidden():
    default = {"hidden_size": 4096, "expand": 2, "num_heads": 128, "head_dim": 64, "n_groups": 8}
    tiny = _shrink(default, {})
    assert tiny["num_heads"] * tiny["head_dim"] == 2 * tiny["hidden_size"]
    assert tiny["num_heads"] % tiny["n_groups"] == 0


def test_an_increasing_list_that_names_no_layers_is_not_a_layer_index_list():
    default = {"hidden_size": 1024, "num_hidden_layers": 24, "resblock_kernel_sizes": [3, 7, 11]}
    assert _shrink(default, {})["resblock_kernel_sizes"] == [3, 7, 11]


def test_per_layer_entries_keep_their_ratios_and_their_head_size_sums():
    default = {"hidden_size": 4096, "num_hidden_layers": 4, "head_dim": 256,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "kv_lora_rank": 512,
               "layer_types": ["full", "full", "sliding", "full"],
               "per_layer_config": {"02": {"qk_nope_head_dim": 192, "kv_lora_rank": 1024}},
               "intermediate_size": [16384] * 4}
    tiny = _shrink(default, {})
    entry = tiny["per_layer_config"]["01"]  # layer 2 became layer 1
    assert entry["kv_lora_rank"] == 2 * tiny["kv_lora_rank"]
    assert entry["head_dim"] == entry["qk_nope_head_dim"] + tiny["qk_rope_head_dim"]
    assert tiny["intermediate_size"] == [64, 64]


def test_shared_tail_layers_hybrids_and_empty_per_kind_settings():
    default = {"hidden_size": 2048, "num_hidden_layers": 6, "num_kv_shared_layers": 2,
               "layer_types": ["sliding", "full"] * 3}
    tiny = _shrink(default, {})  # a producer and a sharer of each kind
    assert tiny["layer_types"] == ["sliding", "full", "sliding", "full"]
    assert tiny["num_kv_shared_layers"] == 2
    hybrid = {"hidden_size": 2048, "num_hidden_layers": 8, "rope_parameters": {},
              "layer_types": ["linear_attention"] * 8, "attn_layer_indices": None}
    tiny = _shrink(hybrid, {})
    assert tiny["layer_types"] == ["linear_attention", "full_attention"]
    assert tiny["attn_layer_indices"] == [1]
    assert set(tiny["rope_parameters"]) == {"linear_attention", "full_attention"}
    axial = {"hidden_size": 256, "axial_pos_embds_dim": [64, 192], "default_language": None,
             "languages": ["en_XX", "de_DE"]}
    tiny = _shrink(axial, {})
    assert sum(tiny["axial_pos_embds_dim"]) == HIDDEN and tiny["default_language"] == "en_XX"


def test_relative_attention_buckets_leave_a_decoders_log_range():
    # T5's decoder buckets distances past num_buckets // 2 by log(distance / that) /
    # log(max_distance / that): max_distance must stay above it (32 and 16 failed eagerly)
    default = {"d_model": 512, "relative_attention_num_buckets": 32,
               "relative_attention_max_distance": 128}
    tiny = _shrink(default, {})
    assert tiny["relative_attention_num_buckets"] == 32  # MPNet's bucket function assumes 32
    assert tiny["relative_attention_max_distance"] > tiny["relative_attention_num_buckets"] // 2
