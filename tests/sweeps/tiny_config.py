"""Tiny configs for every model type of a transformers auto mapping, built generically.

`tiny_config(model_type)` starts from the type's default config (`AutoConfig.for_model`),
shrinks every size it knows by name (hidden sizes, layers, heads, experts, vocabulary) in the
config and its sub-configs, turns dropout off, keeps one layer of each kind of a per-layer
pattern (`layer_types`: one sliding and one full attention layer), moves special token ids into
the small vocabulary, and builds the config again. Nothing here knows a model by name: a type
whose config refuses the shrunk sizes is reported by the sweep as skipped, with the error.
"""

from __future__ import annotations

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
    "pooler_hidden_size": HIDDEN,
    "intermediate_size": FFN, "d_ff": FFN, "n_inner": FFN, "ffn_dim": FFN,
    "encoder_ffn_dim": FFN, "decoder_ffn_dim": FFN, "ffn_hidden_size": FFN,
    "num_hidden_layers": LAYERS, "num_layers": LAYERS, "n_layer": LAYERS, "n_layers": LAYERS,
    "encoder_layers": LAYERS, "decoder_layers": LAYERS, "num_decoder_layers": LAYERS,
    "num_encoder_layers": LAYERS,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS,
    "head_dim": HEAD_DIM, "d_kv": HEAD_DIM, "kv_channels": HEAD_DIM,
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
    "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16,
    "num_buckets": 8, "max_distance": 16,
}
# attributes no larger than this after shrinking (positions stay long enough for the checks)
AT_MOST = {"max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
           "max_seq_len": 128, "max_sequence_length": 128, "block_size": 128}
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers",
                "decoder_layers", "num_decoder_layers", "num_encoder_layers")


def _layer_count(d: dict) -> int | None:
    for key in LAYER_COUNTS:
        if isinstance(d.get(key), int):
            return d[key]
    return None


def _pattern_kept(values: list) -> list:
    """One entry of each distinct value of a per-layer list, in order of first appearance,
    padded with the first value to `LAYERS` entries."""
    kept, seen = [], set()
    for value in values:
        marker = repr(value)
        if marker not in seen:
            seen.add(marker)
            kept.append(value)
    while len(kept) < LAYERS:
        kept.append(values[0])
    return kept


def _shrink(d: dict, renumber: dict) -> dict:
    """`d` (a config's `to_dict()`) with tiny sizes; nested config dicts shrunk too."""
    layers = _layer_count(d)
    out = dict(d)
    patterns = {}
    for key, value in d.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("config")):
            out[key] = _shrink(value, renumber)
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, SIZES[key]) if key in ("num_experts_per_tok",) else SIZES[key]
        elif key in AT_MOST and isinstance(value, int) and value > AT_MOST[key]:
            out[key] = AT_MOST[key]
        elif isinstance(value, float) and ("dropout" in key or "pdrop" in key
                                          or "drop_prob" in key or key == "layerdrop"):
            out[key] = 0.0
        elif isinstance(value, list) and layers and len(value) == layers and layers > LAYERS:
            patterns[key] = _pattern_kept(value)
        elif (key.endswith("token_id") or key.endswith("token_index")) and value is not None:
            out[key] = _renumbered(value, renumber)
    if patterns:  # every per-layer list as long as the longest kept pattern
        count = max(len(v) for v in patterns.values())
        for key, kept in patterns.items():
            out[key] = (kept * count)[:count]
        for key in LAYER_COUNTS:
            if isinstance(out.get(key), int):
                out[key] = count
    if "num_key_value_heads" in d and isinstance(d["num_key_value_heads"], int):
        heads = d.get("num_attention_heads")
        out["num_key_value_heads"] = HEADS if d["num_key_value_heads"] == heads else HEADS // 2
    if "num_kv_heads" in d and isinstance(d["num_kv_heads"], int):
        out["num_kv_heads"] = HEADS // 2
    return out


def _renumbered(value, renumber: dict):
    """A special token id moved into the tiny vocabulary (ids past it get 100, 101, ...)."""
    if isinstance(value, list):
        return [_renumbered(v, renumber) for v in value]
    if not isinstance(value, int) or value < VOCAB - 28:
        return value
    if value not in renumber:
        renumber[value] = VOCAB - 28 + len(renumber) % 28
    return renumber[value]


def tiny_config(model_type: str):
    """The tiny config of `model_type` (raises what the config class raises)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    shrunk = _shrink(default.to_dict(), {})
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


def text_vocab(config) -> int:
    """The vocabulary size of the text the model reads."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or VOCAB
