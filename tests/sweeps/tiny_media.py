"""Tiny sizes for vision and audio configs (called by `tiny_config._shrink`), generic by
attribute name.

A staged vision config (one with a per-stage `depths` / `depth` list: ResNet, Swin, ConvNeXt,
PVT, ...) keeps its stages but gets one block per stage (a per-stage list of per-block lists,
Dinat's `dilations`, keeps each stage's first entry) and every width (`hidden_sizes`,
`embed_dim`, `*channels*`, `hidden_dim`, ...) divided by one power of two, the largest that
leaves the widest at most `WIDEST` (no width below `NARROWEST`) and every width a multiple of its stage's head count. A config
with per-stage width lists but no depths (MobileViT) gets the widths scaled too. Images are at
most `IMAGE` pixels wide, windows at most `WINDOW` patches, whole-network width multipliers at most `MULTIPLIER`, a backbone's
`out_features` picks the last stage. The per-stage counts `num_layers` / `num_stages` stay. An audio feature extractor's
per-layer conv widths (`conv_dim`, `tdnn_dim`) are at most `CONV`, its SpecAugment masking
(`mask_time_prob`, `mask_feature_prob`) off.
"""

from __future__ import annotations

IMAGE = 64       # image_size at most this (patches and strides unchanged)
WIDEST = 128     # the widest stage after shrinking, at most this
NARROWEST = 8    # and no width of at least this narrower than it (RegNet's SE layer: a quarter)
CONV = 32        # a conv feature extractor's widths at most this
CONV_WIDTHS = ("conv_dim", "tdnn_dim")
DEPTH_NAMES = ("depths", "depth")
WINDOW = 2       # window_size of an image model at most this (Swin: the last stage of a
                 # 64-pixel image is 2 patches wide, and a window no wider than any stage)
# float width/depth multipliers of a whole network (EfficientNet, MobileNet): at most this
MULTIPLIERS = ("width_coefficient", "depth_coefficient", "depth_multiplier", "width_multiplier")
MULTIPLIER = 0.5
# stage names a backbone's outputs are picked by: reset (None) so the config picks its last
# stage again (ViT's out_features ['stage12'] names a layer the tiny config drops)
STAGE_PICKS = ("out_features", "out_indices")
# names of widths scaled together (a key containing one of these; never the input channels)
WIDTH_WORDS = ("hidden_sizes", "embed_dim", "channels", "hidden_dims", "hidden_dim",
               "embedding_size", "hidden_size", "class_expand", "groups_width")
NOT_WIDTHS = ("num_channels", "stem_num_channels")
HEAD_LISTS = ("num_heads", "num_attention_heads")
GROUPS = "num_groups"  # a group count scaled with the widths (channels per group kept)


def _ints(value) -> bool:
    return isinstance(value, list) and bool(value) \
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def depths_of(d: dict) -> list[int] | None:
    """The per-stage block counts of a staged config, or None."""
    for key in DEPTH_NAMES:
        if _ints(d.get(key)) and len(d[key]) > 1:
            return d[key]
    return None


def _width_keys(d: dict) -> list[str]:
    return [key for key, value in d.items()
            if any(word in key for word in WIDTH_WORDS) and key not in NOT_WIDTHS
            and (_ints(value) or (isinstance(value, int) and not isinstance(value, bool)))]


def _factor(d: dict, keys: list[str]) -> int:
    """The power of two every width is divided by."""
    widths = [v for key in keys for v in (d[key] if isinstance(d[key], list) else [d[key]])]
    heads = next((d[k] for k in HEAD_LISTS if _ints(d.get(k))), None)
    factor = 1
    while max(widths) // factor > WIDEST \
            and min(w for w in widths if w >= NARROWEST) // (2 * factor) >= NARROWEST:
        factor *= 2
    single = next((d[k] for k in HEAD_LISTS if isinstance(d.get(k), int)), None)
    while factor > 1 and heads is not None and any(
            isinstance(d[key], list) and len(d[key]) == len(heads)
            and any(w % (factor * h) for w, h in zip(d[key], heads)) for key in keys):
        factor //= 2
    while factor > 1 and single and heads is None and any(  # one head count for every stage
            isinstance(d[key], list) and any(w % (factor * single) for w in d[key])
            for key in keys if "hidden_sizes" == key):
        factor //= 2
    return factor


def shrink_media(d: dict, out: dict) -> None:
    """Set the tiny vision and audio sizes of `d` (a config dict) in `out` (its shrunk copy)."""
    for key, value in d.items():  # SpecAugment's random masks in train(): off, as dropout is
        if key.startswith("mask_") and key.endswith("_prob") and isinstance(value, float):
            out[key] = 0.0
    for key in CONV_WIDTHS:
        if _ints(d.get(key)):
            out[key] = [min(v, CONV) for v in d[key]]
    for key in ("image_size", "crop_size"):
        value = d.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > IMAGE:
            out[key] = IMAGE
        elif _ints(value) and max(value) > IMAGE:
            out[key] = [min(v, IMAGE) for v in value]
    if "image_size" in d and isinstance(d.get("window_size"), int) and d["window_size"] > WINDOW:
        out["window_size"] = WINDOW
    for key in MULTIPLIERS:
        if isinstance(d.get(key), float) and d[key] > MULTIPLIER:
            out[key] = MULTIPLIER
    for key in STAGE_PICKS:
        if d.get(key) is not None and "stage_names" in d:
            out[key] = None
    depths = depths_of(d) or []
    for key, value in d.items():
        if not depths:
            break
        if key in DEPTH_NAMES and value is depths:
            out[key] = [1] * len(depths)
        elif isinstance(value, list) and len(value) == len(depths) and all(
                isinstance(v, list) and len(v) == n for v, n in zip(value, depths)):
            out[key] = [v[:1] for v in value]  # per-block entries of each stage
        elif key in ("num_layers", "num_stages") and value == len(depths):
            out[key] = value
    keys = _width_keys(d)
    if not keys or not (depths or any(isinstance(d[key], list) for key in keys)):
        return  # widths of a staged config, or of one with per-stage width lists
    factor = _factor(d, keys)
    if isinstance(d.get(GROUPS), int) and d[GROUPS] % factor == 0:
        out[GROUPS] = d[GROUPS] // factor
    for key in keys:
        value = d[key]
        if isinstance(value, list):
            out[key] = [v // factor if v % factor == 0 else v for v in value]
        elif value % factor == 0:
            out[key] = value // factor
