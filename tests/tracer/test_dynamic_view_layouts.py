"""An input whose layout changes between calls while its sizes vary (issue 16): assisted
generation's cache is contiguous at some decode steps and a cropped view (`keys[..., :n, :]`)
at others. Once seen as a view, it is traced with strides free of its sizes (NOTE [strides of
a view input]) and one entry serves both layouts; what the program decides from its strides
stays a guard. Each call is compared with eager: values and strides."""

import pytest
import torch

import fulmen


def _cache(n: int, view: bool) -> torch.Tensor:
    """A (1, 2, n, 8) cache: contiguous, or the first n positions of a longer one."""
    if view:
        return torch.randn(1, 2, n + 3, 8)[:, :, :n]
    return torch.randn(1, 2, n, 8)


def _append(cache, new):
    return torch.cat([cache, new], dim=-2) * 2  # `DynamicCache.update`, then attention


def _reduced(cache, new):
    return cache.sum(-2, keepdim=True) + new  # its layout follows the cache's stride order


def _branching(cache, new):
    if cache.is_contiguous():  # a decision about strides: the entry must guard it
        return cache.view(1, -1) + new.sum()
    return cache.reshape(1, -1) * 3


def _calls():
    """(n, view) of a decode loop that crops at some steps: a view first, then alternating."""
    return [(6, True), (7, False), (8, False), (9, True), (10, False), (12, True), (13, False)]


def test_a_cache_seen_as_a_view_gets_one_entry_for_both_layouts():
    jfn = fulmen.jit(_append)
    for n, view in _calls():
        cache, new = _cache(n, view), torch.randn(1, 2, 1, 8)
        out, expected = jfn(cache, new), _append(cache, new)
        torch.testing.assert_close(out, expected)
        assert out.stride() == expected.stride(), (n, view)
    # the first call (a view, static), the second (contiguous: sizes vary, strides free), and
    # no more: before, each layout had entries of its own (4)
    assert fulmen.cache_misses(jfn) == 2


@pytest.mark.parametrize("fn", [_branching, _reduced])
def test_decisions_about_strides_keep_the_layouts_apart(fn):
    """A branch on `is_contiguous()`, and a layout computed from the strides, are guards: the
    entry traced with a contiguous cache is not reused for a view, nor the other way."""
    jfn = fulmen.jit(fn)
    for n, view in _calls() + [(15, True), (16, False)]:
        cache, new = _cache(n, view), torch.randn(1, 2, 1, 8)
        out, expected = jfn(cache, new), fn(cache, new)
        torch.testing.assert_close(out, expected)
        assert out.stride() == expected.stride(), (n, view)
    assert fulmen.cache_misses(jfn) <= 3


def _last_token(tokens, table):
    picked = table[tokens]  # an embedding of the last token
    return picked * 2, tokens.clone(), tokens.stride(0) > 0, torch.empty_like(tokens)


def test_a_view_whose_strides_alone_vary_gets_one_entry():
    """A decoding loop feeding `generated[:, -1:]` (HF classifier-free guidance, hand-written
    loops): the (1, 1) token view keeps its sizes while its row stride grows with `generated`
    at every call. Its strides go symbolic (NOTE [strides that vary under fixed sizes]), so one
    entry serves every step (before: one compile per step, past `cache_size_limit` eagerly),
    and outputs laid out from the input (`clone`, `empty_like`) keep eager's strides."""
    jfn = fulmen.jit(_last_token)
    table, generated = torch.randn(10, 4), torch.tensor([[3, 1, 4]])
    for step in range(12):
        generated = torch.cat([generated, torch.tensor([[step % 10]])], dim=1)
        tokens = generated[:, -1:]
        out, expected = jfn(tokens, table), _last_token(tokens, table)
        for got, want in zip(out, expected):
            if isinstance(want, torch.Tensor):
                assert got.stride() == want.stride(), step
                if want is not expected[3]:
                    torch.testing.assert_close(got, want)
            else:
                assert got == want
    stats = fulmen.compile_stats(jfn)
    assert stats.cache_misses <= 2 and stats.eager_calls == 0
    # the reason names the strides (it said "the input structure changed")
    assert stats.recompile_reasons[0] == ["tokens.stride() changed from (4, 1) to (5, 1)"]
