"""The cache limits of a jitted function (NOTE [cache limits per call structure] in
`fulmen/cache_policy.py`): `cache_size_limit` entries per call structure, an accumulated cap over
all structures, and a warning that names the guard that kept failing."""

import warnings

import torch

import fulmen


def _fn(x, y=None, mask=None):
    out = torch.sin(x) * 2
    if y is not None:
        out = out + y.sum()
    if mask is not None:
        out = out * mask
    return out


def _calls(structures: int, sizes=(3, 4)):
    """Calls of `structures` structures (x; x, y; x, y, mask positionally; x, mask=), each
    at `sizes`."""
    for n in sizes:
        x, y, mask = torch.randn(n), torch.randn(2), torch.ones(n)
        kinds = [((x,), {}), ((x, y), {}), ((x, y, mask), {}), ((x,), {"mask": mask})]
        yield from kinds[:structures]


def test_each_call_structure_has_its_own_cache_size_limit():
    """Three structures at two shapes each with `cache_size_limit=2`: every call compiled
    (before: the limit counted all six entries together, and the last four calls ran
    eagerly although no guard kept failing)."""
    jfn = fulmen.jit(_fn, cache_size_limit=2, dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no limit warning
        for args, kwargs in _calls(3):
            torch.testing.assert_close(jfn(*args, **kwargs), _fn(*args, **kwargs))
    stats = fulmen.compile_stats(jfn)
    assert stats.cache_misses == 6 and stats.eager_calls == 0, stats


def test_the_warning_names_the_guard_that_kept_failing_in_its_structure():
    """`x`'s size changes at every call of one structure, calls of another come between: the
    limit is reached in the first, and the warning names `x.shape` (retraced each time there),
    not what differs from the other structure's call before it."""
    jfn = fulmen.jit(_fn, cache_size_limit=3, dynamic=False)
    fixed = torch.randn(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 7):
            x = torch.randn(n)
            torch.testing.assert_close(jfn(x), _fn(x))
            torch.testing.assert_close(jfn(fixed, y=fixed), _fn(fixed, y=fixed))
    stats = fulmen.compile_stats(jfn)
    assert stats.cache_misses == 7 and stats.eager_calls == 3, stats
    messages = [str(w.message) for w in caught if "cache_size_limit" in str(w.message)]
    assert len(messages) == 1, messages
    assert "the guard that kept failing is x.shape (" in messages[0], messages[0]
    assert "y is gone" not in messages[0], messages[0]


def test_the_accumulated_limit_caps_the_entries_of_all_structures(monkeypatch):
    monkeypatch.setenv("FULMEN_ACCUMULATED_CACHE_SIZE_LIMIT", "3")
    jfn = fulmen.jit(_fn, cache_size_limit=2, dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for args, kwargs in _calls(4, sizes=(3,)):
            torch.testing.assert_close(jfn(*args, **kwargs), _fn(*args, **kwargs))
    stats = fulmen.compile_stats(jfn)
    assert stats.cache_misses == 4 and stats.eager_calls == 1, stats
    assert sum("FULMEN_ACCUMULATED_CACHE_SIZE_LIMIT" in str(w.message) for w in caught) == 1


def test_the_limit_is_never_below_the_per_structure_limit(monkeypatch):
    monkeypatch.setenv("FULMEN_ACCUMULATED_CACHE_SIZE_LIMIT", "1")
    jfn = fulmen.jit(_fn, cache_size_limit=3, dynamic=False)
    for n in (2, 3, 4):
        x = torch.randn(n)
        torch.testing.assert_close(jfn(x), _fn(x))
    assert fulmen.compile_stats(jfn).eager_calls == 0


def _total(x, items):
    return x + sum(item.sum() for item in items)


def test_a_list_that_grows_at_every_call_is_one_structure():
    """The length of a list argument is no part of the structure: a list that grows at every
    call compiles `cache_size_limit` times, then runs eagerly, as a size that keeps changing
    (counted as new structures, it compiled up to the accumulated cap of 64)."""
    jfn = fulmen.jit(_total, cache_size_limit=3)
    x, items = torch.randn(3), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            items.append(torch.randn(2))
            torch.testing.assert_close(jfn(x, list(items)), _total(x, items))
    assert fulmen.compile_stats(jfn).eager_calls == 3
    assert sum("cache_size_limit" in str(w.message) for w in caught) == 1
