"""Tiny configs for every model type of a transformers auto mapping, built generically.

`tiny_config(model_type)` starts from the type's default config (`AutoConfig.for_model`),
shrinks every size it knows by name (hidden sizes, layers, heads, experts, vocabulary; a size
1, 2 or 4 times the hidden size keeps that ratio) in the config and its sub-configs, fills the
None sizes a model cannot do without, turns dropout off, keeps the first layer of each kind (the
layer's entries in every per-layer list, layer-index list and layer-indexed dict together: one
sliding and one full attention layer), moves special token ids into the small vocabulary, and
builds the config again; `config_for` picks the sub-config a text-only class is built from.
The rules know no model by name, except `CHECKPOINT_FACTS` and `DEFAULT_FIXES`: per-type facts
every released checkpoint's config carries and the default config lacks or gets wrong (a
sub-config field the model reads, layer sections that add up, a width one sub-config hands to
another); without them transformers refuses the tiny config, or its model fails at any size, while
a user loading the real config runs the model. A type whose config still refuses the shrunk sizes
is reported by the sweep as skipped, with the error."""

from __future__ import annotations

from tests.sweeps.tiny_media import shrink_media

VOCAB = 128
LAYERS = 2
HIDDEN = 32
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
FFN = 64

# config attribute -> its tiny value (only attributes the default config has are set)
SIZES = {
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "n_embed": HIDDEN,
    "embed_dim": HIDDEN, "word_embed_proj_dim": HIDDEN, "embedding_size": HIDDEN, "dim": HIDDEN,
    "pooler_hidden_size": HIDDEN, "emb_dim": HIDDEN,
    "intermediate_size": FFN, "d_ff": FFN, "n_inner": FFN, "ffn_dim": FFN,
    "encoder_ffn_dim": FFN, "decoder_ffn_dim": FFN, "ffn_hidden_size": FFN,
    "num_hidden_layers": LAYERS, "num_layers": LAYERS, "n_layer": LAYERS, "n_layers": LAYERS,
    "encoder_layers": LAYERS, "decoder_layers": LAYERS, "num_decoder_layers": LAYERS,
    "num_encoder_layers": LAYERS,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS,
    "head_dim": HEAD_DIM, "d_kv": HEAD_DIM, "d_head": HEAD_DIM, "kv_channels": HEAD_DIM,
    "attention_head_size": HEAD_DIM,
    "qk_rope_head_dim": HEAD_DIM, "qk_nope_head_dim": HEAD_DIM, "v_head_dim": HEAD_DIM,
    "kv_lora_rank": 16, "q_lora_rank": 16,
    "vocab_size": VOCAB, "decoder_vocab_size": VOCAB, "rotary_dim": HEAD_DIM // 2,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "n_group": 1, "topk_group": 1,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "n_shared_experts": 1,
    "state_size": 4, "ssm_state_size": 4, "mamba_d_state": 4, "time_step_rank": 4,
    "mamba_n_heads": 4, "mamba_d_head": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "sliding_window": 8, "attention_window": 4, "local_attention": 8,
    "num_buckets": 8, "max_distance": 16,
    # model-family spellings of the same sizes (kept generic: a name, not a model)
    "qk_head_dim": 2 * HEAD_DIM, "linear_head_dim": HEAD_DIM, "linear_num_heads": HEADS,
    "swa_head_dim": HEAD_DIM, "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": HEADS // 2,
    "index_head_dim": HEAD_DIM, "index_n_heads": HEADS, "index_topk": 4,
    "num_experts_per_token": 2, "num_expert_group": 1, "num_shared_experts": 1,
    "expert_ffn_hidden_size": 32, "shared_experts_intermediate_size": 32, "zero_expert_num": 2,
    "intermediate_size_mlp": FFN, "lru_width": HIDDEN, "hidden_size_global": HIDDEN,
    "hidden_size_per_layer_input": 8, "pronunciation_embed_dim": 16, "shape_embed_dim": 16,
    "attention_window_size": 8, "sliding_window_size": 8, "attention_chunk_size": 8,
    "mamba_d_ssm": 4 * 16,  # mamba_n_heads * mamba_d_head (Falcon-H1 checks it)
    "indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
    "indexer_budget": 8, "indexer_compress_ratio": 4,
    # Zamba2's spellings: its attention and Mamba heads each span twice the hidden size
    "n_mamba_heads": HEADS, "mamba_headdim": 2 * HIDDEN // HEADS,
    "attention_head_dim": 2 * HIDDEN // HEADS,
}
# attributes no larger than this after shrinking (positions stay long enough for the checks)
# (relative attention buckets: MPNet's bucket function assumes 32; T5's decoder needs a
# `relative_attention_max_distance` above half of them, so that keeps its default)
AT_MOST = {"relative_attention_num_buckets": 32,
           "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
           "max_seq_len": 128, "max_sequence_length": 128, "block_size": 128}
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers",
                "decoder_layers", "num_decoder_layers", "num_encoder_layers")
# sizes a default config may leave None although its model cannot be built without them (the
# class computes no default: e.g. Ministral's `head_dim`, Nemotron's `num_key_value_heads`,
# DeepSeek-V2's `num_experts_per_tok`, a CTC head's `vocab_size`); None stays None for every
# other name (often "off")
NONE_FILLED = ("head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts",
               "n_shared_experts", "n_group", "topk_group", "vocab_size", "indexer_n_heads",
               "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
# counts of the last layers of a model that are of one kind (Gemma-3n's layers reusing an
# earlier layer's keys and values): kept as a kind of layer, then counted again
TAIL_COUNTS = ("num_kv_shared_layers",)
# per-layer attention kinds of a hybrid (SSM + attention) model; a default config of only
# linear layers (Bamba, GraniteMoeHybrid: their checkpoints have attention layers; transformers'
# mask code then fails eagerly) gets its last kept layer as attention
LINEAR_KIND, ATTENTION_KIND = "linear_attention", "full_attention"
# counts a config derives from `num_hidden_layers` in `__post_init__` and stores: set to None so
# the shrunk config derives them again (HRM's layers per stack)
DERIVED = ("num_layers_per_stack",)
# per-type facts of the released checkpoints' configs, merged into the shrunk config (nested
# dicts merged key by key); each names where the default goes wrong
CHECKPOINT_FACTS = {
    # DbrxAttention reads `attn_config.rope_theta`, which every DBRX config.json has
    # (500000) and `DbrxAttentionConfig` does not declare; it clamps q, k, v by `clip_qkv`
    # unconditionally (8 in every checkpoint, None by default)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # three layers (an input, a recurrent and an output section of one layer each; sliding and
    # full attention), in `to_dict`'s spelling: each layer an attention and an mlp block, and the
    # section counts doubled with it
    "dory": {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2,
             "n_output_layers": 2,
             "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp",
                             "sliding_attention", "mlp"]},
    # the adapters hand the text model its hidden width
    "dots3_note": {"vision_config": {"adapter_out_dim": HIDDEN},
                   "audio_config": {"adapter_out_dim": HIDDEN}},
    # the shared hybrid block is tied across hybrid layers: two of them (and a mamba layer)
    "zamba": {"num_hidden_layers": 3, "mamba_dt_rank": "auto",
              "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # ESM checkpoints pad with id 1 and mask with id 32 (the default leaves both None and the
    # embedding reads `input_ids.ne(padding_idx)`)
    "esm": {"pad_token_id": 1, "mask_token_id": 32},
    # the full-attention layers rotate a quarter of each head in M-RoPE pairs of pairs: a head
    # of 16 (NeoMME's checkpoints: 256) rotates 4
    "neomme": {"head_dim": 2 * HEAD_DIM},
    # semantic segmentation reads four layers' features (`out_indices`, [3, 5, 7, 11] in the
    # checkpoints): four layers, each one picked
    "beit": {"num_hidden_layers": 4, "out_indices": [1, 2, 3, 4]},
    "data2vec-vision": {"num_hidden_layers": 4, "out_indices": [1, 2, 3, 4]},
    # UperNet's heads read every backbone stage (the auxiliary head the third)
    "upernet": {"backbone_config": {"out_features": ["stage1", "stage2", "stage3", "stage4"]}},
    # Sapiens2's segmentation head is two upsampling blocks and a refining conv in its
    # checkpoints; the default head config has none and its model cannot be built
    # and its per-layer key/value head counts (16 and 8 of 16 heads) are a share of the heads
    "sapiens2": {"head_config": {"upsample_out_channels": [16, 16], "conv_out_channels": [16]},
                 "num_key_value_heads_per_layer": [HEADS, HEADS // 2],
                 "num_key_value_attention_heads": HEADS // 2},
    # xLSTM's cache sizes the heads by widths rounded up to 64 and its layers by the unrounded
    # hidden * factor (4096 * 0.5 in the checkpoints): tiny widths of 64 agree
    "xlstm": {"qk_dim_factor": 64 / HIDDEN, "v_dim_factor": 64 / HIDDEN,
              "num_blocks": LAYERS},  # its layer count, spelled twice
    # CvT's stage s reads entry s of a list `depth[s]` long (its drop-path rates): stage s
    # needs more than s blocks (the checkpoints: [1, 2, 10])
    "cvt": {"depth": [1, 2, 3]},
    # see DEFAULT_FIXES (the size rules would set the per-layer input width again)
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0}},
}
# per-type keyword arguments the default config is built with, where transformers' own default
# fails its validator (Gemma-4 assistants: a text config without per-layer inputs)
DEFAULT_FIXES = {
    # MusicGen's generate starts every codebook's delay pattern with `decoder_start_token_id`
    # (2048, the pad and bos id, in every checkpoint's generation config; the decoder config
    # leaves it None and generate fails)
    "musicgen": {"decoder": {"decoder_start_token_id": 2048}},
    "musicgen_melody": {"decoder": {"decoder_start_token_id": 2048}},
    "gemma4_assistant": {"text_config": {"model_type": "gemma4_text",
                                         "hidden_size_per_layer_input": 0,
                                         "vocab_size_per_layer_input": 0}},
}
PATTERN_MAX = 4  # a short list of layer kinds cycled over the layers (RecurrentGemma's
                 # `block_types`) gets at least that many layers, so each kind runs


def _layer_count(d: dict) -> int | None:
    for key in LAYER_COUNTS:
        if isinstance(d.get(key), int):
            return d[key]
    return None


def _old_hidden(d: dict) -> int | None:
    value = next((d[k] for k in ("hidden_size", "d_model", "n_embd") if k in d), None)
    return value if isinstance(value, int) and value > HIDDEN else None


def _hidden_multiple(key: str, value, d: dict) -> bool:
    """A size or dim named by no rule that is 1, 2 or 4 times the default hidden size (a width
    the model derives from it: RWKV's `attention_hidden_size`, xLSTM's `embedding_dim`)."""
    hidden = _old_hidden(d)
    return hidden is not None and ("size" in key or "dim" in key or "channel" in key) \
        and isinstance(value, int) and not isinstance(value, bool) \
        and value in (hidden, 2 * hidden, 4 * hidden)


def _layer_indexed(value, layers: int) -> bool:
    """A dict of dicts keyed by layer index below `layers` (`per_layer_config`:
    {"05": {"head_dim": 512}, ...}; not `id2label`)."""
    if not isinstance(value, dict) or not value \
            or not all(isinstance(entry, dict) for entry in value.values()):
        return False
    try:
        return all(0 <= int(key) < layers for key in value)
    except (TypeError, ValueError):
        return False


def _index_list(key: str, value, layers: int) -> bool:
    """A list of layer indices, increasing, below `layers`, under a name that says so (Llama4's
    `moe_layers`, LFM2's `full_attn_idxs`; not SeamlessM4T's `resblock_kernel_sizes`)."""
    return any(word in key for word in ("layer", "idx", "indices")) \
        and isinstance(value, list) and bool(value) \
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value) \
        and all(a < b for a, b in zip(value, value[1:])) and 0 <= value[0] and value[-1] < layers


def _kept_layers(lists: dict, indexed: dict, index_lists: dict, layers: int) -> list[int]:
    """The first layer of each distinct kind (its entries in every per-layer list, layer-indexed
    dict and index list together), in order, padded with layer 0 to `LAYERS` layers."""
    kept, seen = [], set()
    for i in range(layers):
        marker = repr(([v[i] for v in lists.values()], [i in v for v in index_lists.values()],
                       [{int(k): e for k, e in d.items()}.get(i) for d in indexed.values()]))
        if marker not in seen:
            seen.add(marker)
            kept.append(i)
    while len(kept) < LAYERS:
        kept.append(0)
    return kept


def _reindexed(d: dict, kept: list[int]) -> dict:
    """A layer-indexed dict for the kept layers, renumbered (keys keep their type and width)."""
    first = next(iter(d))
    by_index = {int(k): e for k, e in d.items()}
    return {(f"{new:0{len(first)}d}" if isinstance(first, str) else new): by_index[old]
            for new, old in enumerate(kept) if old in by_index}


def _shrink(d: dict, renumber: dict) -> dict:
    """`d` (a config's `to_dict()`) with tiny sizes; nested config dicts shrunk too. The layers
    kept are one of each kind; every per-layer list and layer-indexed dict keeps those."""
    layers = _layer_count(d)
    out = dict(d)
    lists, indexed, index_lists = {}, {}, {}
    tails = {key: list(range(layers - d[key], layers)) for key in TAIL_COUNTS
             if layers and layers > LAYERS and isinstance(d.get(key), int) and 0 < d[key] <= layers}
    for key, value in d.items():
        if layers and layers > LAYERS and _index_list(key, value, layers):
            index_lists[key] = value
        elif layers and layers > LAYERS and isinstance(value, list) and len(value) == layers:
            lists[key] = value
        elif layers and layers > LAYERS and _layer_indexed(value, layers):
            indexed[key] = value
        elif key.endswith("attn_layer_indices") and value is None and layers:
            out[key] = [min(layers, LAYERS) - 1]  # see LINEAR_KIND
        elif key == "default_language" and value is None and d.get("languages"):
            out[key] = list(d["languages"])[0]  # X-MOD refuses to run without one
        elif _sums_to_hidden(value, d):
            out[key] = _scaled_to_hidden(value, d)  # Reformer's axial_pos_embds_dim
        elif isinstance(value, dict) and ("model_type" in value or key.endswith("config")):
            out[key] = _shrink(value, renumber)
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, SIZES[key]) if key in ("num_experts_per_tok",) else SIZES[key]
        elif ("vocab_size" in key or key.endswith("_vocab")) and isinstance(value, int) \
                and not isinstance(value, bool):
            out[key] = min(value, VOCAB)  # unpadded_vocab_size, BLT's hash_byte_group_vocab, ...
        elif _hidden_multiple(key, value, d):
            out[key] = HIDDEN * value // _old_hidden(d)  # RWKV's attention_hidden_size
        elif key in DERIVED:
            out[key] = None
        elif key.endswith("_layer_period") and isinstance(value, int):
            out[key] = min(value, LAYERS)  # every other layer (Jamba's attention, experts)
        elif key.endswith("_layer_offset") and isinstance(value, int):
            out[key] = min(value, LAYERS - 1)
        elif key == "layer_types" and value is None and layers:
            out[key] = ["full_attention"] * LAYERS  # a model that reads it unconditionally
        elif key in NONE_FILLED and value is None:
            out[key] = SIZES.get(key, HEADS)
        elif key in AT_MOST and isinstance(value, int) and value > AT_MOST[key]:
            out[key] = AT_MOST[key]
        elif isinstance(value, float) and ("dropout" in key or "pdrop" in key
                                          or "drop_prob" in key or key == "layerdrop"):
            out[key] = 0.0
        elif (key.endswith("token_id") or key.endswith("token_index")) and value is not None:
            out[key] = _renumbered(value, renumber)
    cycled = [v for v in d.values() if isinstance(v, list) and layers and 1 < len(v) < layers
              and len(v) <= PATTERN_MAX and all(isinstance(e, str) for e in v)]
    if cycled and not (lists or indexed or index_lists):
        for key in LAYER_COUNTS:
            if isinstance(out.get(key), int):
                out[key] = max(LAYERS, *(len(v) for v in cycled))
    indexed = {key: {index: _layer_entry(entry, d, out, renumber) for index, entry in value.items()}
               for key, value in indexed.items()}
    if lists or indexed or index_lists or tails:
        kept = _kept_layers(lists, indexed, {**index_lists, **tails}, layers)
        for key, value in lists.items():
            out[key] = [_per_layer_size(key, value, i) for i in kept]
        for key, value in index_lists.items():
            out[key] = [new for new, old in enumerate(kept) if old in value]
        for key, value in tails.items():
            out[key] = sum(old in value for old in kept)
        for key, value in indexed.items():
            out[key] = _reindexed(value, kept)
        for key in LAYER_COUNTS:
            if isinstance(out.get(key), int):
                out[key] = len(kept)
    kinds = out.get("layer_types")
    if isinstance(kinds, list) and kinds and all(kind == LINEAR_KIND for kind in kinds):
        out["layer_types"] = kinds[:-1] + [ATTENTION_KIND]
    if d.get("rope_parameters") == {} and isinstance(out.get("layer_types"), list):
        # one RoPE per layer kind, read unconditionally (Cohere-Compass's default config leaves
        # it empty and cannot build its model)
        out["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                  for kind in dict.fromkeys(out["layer_types"])}
    if "num_key_value_heads" in d and isinstance(out["num_key_value_heads"], int):
        heads = d.get("num_attention_heads")
        out["num_key_value_heads"] = HEADS if d["num_key_value_heads"] in (heads, None) \
            else HEADS // 2
    if isinstance(d.get("expand"), int) and isinstance(d.get("num_heads"), int) \
            and isinstance(d.get("head_dim"), int) and _old_hidden(d) \
            and d["num_heads"] * d["head_dim"] == d["expand"] * _old_hidden(d):
        out["head_dim"] = d["expand"] * HIDDEN // HEADS  # Mamba2's heads span expand * hidden
        if isinstance(d.get("n_groups"), int) and HEADS % d["n_groups"]:
            out["n_groups"] = 1
    if "num_kv_heads" in d and isinstance(d["num_kv_heads"], int):
        out["num_kv_heads"] = HEADS // 2
    parts = ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim")
    if all(isinstance(d.get(k), int) and isinstance(out.get(k), int) for k in parts) \
            and d["head_dim"] == d["qk_nope_head_dim"] + d["qk_rope_head_dim"]:
        out["head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]  # Mistral-4's MLA heads
    shrink_media(d, out)
    return out


def _per_layer_size(key: str, value: list, i: int):
    """Layer `i`'s entry of a per-layer list; a size named in SIZES (Gemma-3n's per-layer
    `intermediate_size`; not a per-stage head count) shrunk, keeping its ratio to the list's largest."""
    entry = value[i]
    if key in SIZES and "heads" not in key \
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        return max(1, SIZES[key] * entry // max(value))
    return entry


def _sums_to_hidden(value, d: dict) -> bool:
    """A list of widths that add up to the hidden size (Reformer's axial position embedding
    widths, one per axis)."""
    hidden = _old_hidden(d)
    return hidden is not None and isinstance(value, (list, tuple)) and len(value) > 1 \
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value) \
        and sum(value) == hidden and all(HIDDEN * v % hidden == 0 for v in value)


def _scaled_to_hidden(value, d: dict) -> list:
    hidden = _old_hidden(d)
    return [HIDDEN * v // hidden for v in value]


def _layer_entry(entry, d: dict, out: dict, renumber: dict):
    """One layer's entry of a layer-indexed dict (`per_layer_config`), shrunk: its sizes keep
    their ratio to the config's own (Gemma-4's global layers: twice the head size), and a head
    size that was the sum of the no-RoPE and RoPE parts stays that sum (Dots3's sliding
    layers)."""
    if not isinstance(entry, dict):
        return entry
    new = _shrink(entry, renumber)
    for key, value in entry.items():
        top = d.get(key)
        if key in SIZES and "heads" not in key and isinstance(value, int) \
                and isinstance(top, int) and top > 0 and isinstance(out.get(key), int):
            new[key] = max(1, out[key] * value // top)
    parts = ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim")
    before, after = {**d, **entry}, {**out, **new}
    if all(isinstance(before.get(k), int) for k in parts) \
            and before["head_dim"] == before["qk_nope_head_dim"] + before["qk_rope_head_dim"]:
        new["head_dim"] = after["qk_nope_head_dim"] + after["qk_rope_head_dim"]
    return new


def _renumbered(value, renumber: dict):
    """A special token id moved into the tiny vocabulary (ids past it get 100, 101, ...)."""
    if isinstance(value, list):
        return [_renumbered(v, renumber) for v in value]
    if not isinstance(value, int) or value < VOCAB - 28:
        return value
    if value not in renumber:
        renumber[value] = VOCAB - 28 + len(renumber) % 28
    return renumber[value]


def _merged(d: dict, facts: dict) -> dict:
    """`d` with `facts` set (a dict under a key whose value is a dict merged into it)."""
    out = dict(d)
    for key, value in facts.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) \
            and isinstance(out.get(key), dict) else value
    return out


def tiny_config(model_type: str):
    """The tiny config of `model_type` (raises what the config class raises)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type, **DEFAULT_FIXES.get(model_type, {}))
    shrunk = _merged(_shrink(default.to_dict(), {}), CHECKPOINT_FACTS.get(model_type, {}))
    config = type(default).from_dict(shrunk)
    if getattr(config, "is_encoder_decoder", False) \
            and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    return config


def model_class(class_name):
    """The transformers class a mapping names (the first of a tuple of names)."""
    import transformers

    if isinstance(class_name, (tuple, list)):
        class_name = class_name[0]
    return getattr(transformers, class_name)


def config_for(cls, config):
    """The config `cls` is built from: `config`, or its sub-config of `cls.config_class` when
    the class is the text model of a composite config (Llama4ForCausalLM takes the
    Llama4TextConfig of a Llama4Config)."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for value in vars(config).values():
        if isinstance(value, wanted):
            return value
    return config


def text_vocab(config) -> int:
    """The vocabulary size of the text the model reads."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or VOCAB
