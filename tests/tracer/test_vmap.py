"""`torch.vmap` inside traced code, emulated by broadcasting (NOTE [vmap by broadcasting] in
`fulmen.tracer.vmap`): HF's masks with or/and mask functions compile (values, gradients and
symbolic sizes as without vmap), and what broadcasting would get wrong runs eagerly."""

import copy
import threading
import warnings

import pytest
import torch
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    or_masks,
    sdpa_mask,
    sliding_window_overlay,
)

import fulmen


def _calls(jitted, fn, inputs):
    """Each call's result equals eager's; the eager-fallback warnings given."""
    eager_warnings = []
    for args in inputs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = jitted(*args)
        eager_warnings += [str(w.message) for w in caught if "eager" in str(w.message)]
        want = fn(*args)
        for g, w in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,)):
            assert g.shape == w.shape and g.stride() == w.stride()
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    return eager_warnings


def _hf_mask(x, pad):
    batch, length = pad.shape
    mask = sdpa_mask(batch_size=batch, q_length=length, kv_length=length, attention_mask=pad,
                     mask_function=and_masks(or_masks(causal_mask_function,
                                                      lambda b, h, q, kv: kv == 0),
                                             sliding_window_overlay(3)),
                     use_vmap=True, allow_is_causal_skip=False)
    return torch.where(mask, x, -1.0), mask


def test_hf_vmap_masks_compile_with_symbolic_sizes():
    jitted = fulmen.jit(_hf_mask)
    inputs = []
    for length in (6, 7, 9, 11):
        pad = torch.ones(2, length, dtype=torch.bool)
        pad[0, :2] = False
        inputs.append((torch.randn(2, 1, length, length), pad))
    assert _calls(jitted, _hf_mask, inputs) == []
    assert fulmen.compile_stats(jitted).cache_misses == 2  # the second one symbolic


def test_gemma3_with_bidirectional_attention_trains_as_eager():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, sliding_window=4, use_bidirectional_attention=True,
                              pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(twin)
    for length in (7, 9):
        ids = torch.randint(1, 64, (2, length))
        mask = torch.ones(2, length, dtype=torch.long)
        mask[0, :2] = 0
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no eager fallback
            out = jitted(input_ids=ids, attention_mask=mask, labels=ids)
        want = model(input_ids=ids, attention_mask=mask, labels=ids)
        torch.testing.assert_close(out.logits, want.logits)
        out.loss.backward()
        want.loss.backward()
        for mine, theirs in zip(twin.parameters(), model.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad)


def test_vmap_over_rows_with_an_unmapped_vector_compiles():
    w = torch.randn(5)

    def fn(x):
        return torch.vmap(lambda row: (row * w + 1).relu())(x), torch.vmap(
            lambda i: torch.tensor(2.0))(torch.arange(x.shape[0]))

    assert _calls(fulmen.jit(fn), fn, [(torch.randn(3, 5),), (torch.randn(4, 5),)]) == []


@pytest.mark.parametrize("case", ["shape read", "reduction", "wider unmapped tensor"])
def test_what_broadcasting_would_get_wrong_runs_eagerly(case):
    wide = torch.randn(3, 5)  # as many rows as the batch: broadcasting would pair them
    mapped = {
        "shape read": lambda row: row * row.shape[0],  # 5 under vmap, not the stand-in's 3
        "reduction": lambda row: row - row.sum(),  # the row's sum, not the batch's
        "wider unmapped tensor": lambda row: row * wide,  # (3, 5) per row
    }[case]

    def fn(x):
        return torch.vmap(mapped)(x)

    found = _calls(fulmen.jit(fn), fn, [(torch.randn(3, 5),)])
    assert any("torch.vmap over traced tensors" in message for message in found)


def test_random_draws_inside_vmap_raise_as_in_eager():
    def fn(x):
        return torch.vmap(lambda i: i + torch.rand(()))(x)

    with pytest.raises(RuntimeError, match="random"):
        fn(torch.randn(3))
    with pytest.raises(RuntimeError, match="random"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fulmen.jit(fn)(torch.randn(3))


def test_gemma3_with_images_trains_as_eager():
    """Gemma 3's image tokens attend to each other both ways: HF's or-mask over
    `token_type_ids` is built with vmap at every call with images (it ran eagerly)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, image_size=28, patch_size=7)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    twin = copy.deepcopy(model)
    ids = torch.randint(1, 290, (2, 12))
    ids[:, 2:6] = 299
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 0] = 0
    inputs = dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(2, 3, 28, 28),
                  token_type_ids=(ids == 299).long(), labels=ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no eager fallback
        out = fulmen.jit(twin)(**inputs)
    want = model(**inputs)
    torch.testing.assert_close(out.logits, want.logits)
    out.loss.backward()
    want.loss.backward()
    for mine, theirs in zip(twin.parameters(), model.parameters()):
        assert (mine.grad is None) == (theirs.grad is None)
        if theirs.grad is not None:  # the projector's gradients reach 6e5: rounding scales
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4,
                                       atol=1e-6 * max(1.0, theirs.grad.abs().max().item()))


def test_a_trace_ending_in_another_thread_leaves_this_ones_vmap_emulated():
    """The emulation of `torch.func.vmap` is switched on while any trace records
    (`ProcessSwitch`): a `fulmen.vjp` traced in another thread that ends while this thread's
    trace goes on must not switch it off (the call then ran eagerly, torch's vmap refusing
    the traced tensors), nor off twice."""
    started, other_done = threading.Event(), threading.Event()

    def fn(x):
        y = x * 3
        started.set()
        assert other_done.wait(timeout=60)
        return torch.func.vmap(lambda row: row.sin() * 2)(y)

    def other():
        started.wait(timeout=60)
        try:
            fulmen.vjp(lambda z: (z * 2).sum(), torch.ones(3))  # (draws no random numbers)
        finally:
            other_done.set()

    x = torch.randn(4, 2)
    started.set(), other_done.set()
    expected = fn(x)
    started.clear(), other_done.clear()
    helper = threading.Thread(target=other)
    helper.start()
    jfn = fulmen.jit(fn)
    try:
        actual = jfn(x)
    finally:
        other_done.set()
        helper.join()
    torch.testing.assert_close(actual, expected)
    assert fulmen.compile_stats(jfn).eager_calls == 0
