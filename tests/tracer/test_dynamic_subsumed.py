"""A static cache entry whose every call a later entry with symbolic sizes takes is dropped
(NOTE [subsumed entries] in `fulmen.tracer.subsumed`), so it no longer counts toward
`cache_size_limit`; one the symbolic entry does not take (another dtype, a size 1 or a size its
guards exclude) is kept. Every call equals eager's."""

import gc
import weakref

import torch

import fulmen


def _head(x, n):
    return (x[:, :3] * 2).sum(0) + n


def _call(jfn, fn, *args, exact=True):
    torch.testing.assert_close(jfn(*args), fn(*args), **(dict(rtol=0, atol=0) if exact else {}))


def _misses(jfn) -> int:
    return fulmen.compile_stats(jfn).cache_misses


def test_a_static_entry_the_symbolic_entry_takes_is_dropped_the_others_kept():
    jfn = fulmen.jit(_head)
    x4, x1 = torch.randn(4, 4).t(), torch.randn(1, 4).t()  # views, as the entries key them
    _call(jfn, _head, x4, 4)  # static: (4, 4)
    _call(jfn, _head, x4.double(), 4)  # static: float64
    _call(jfn, _head, x1, 1)  # static: the size 1 and the 1 are specialised
    stats = fulmen.compile_stats(jfn)
    dropped = weakref.ref(stats.cache[next(iter(stats.cache))])
    assert len(stats.cache) == 3
    _call(jfn, _head, torch.randn(6, 4).t(), 6)  # symbolic: 3 <= size, size != 3, 2 <= n
    gc.collect()
    # the float32 entry at 4 is taken by the symbolic one and dropped (and collected); the
    # float64 one and the one at 1 stay
    assert len(stats.cache) == 2 and dropped() is None
    misses = _misses(jfn)
    for _ in range(2):
        for args in ((x4, 4), (x4.double(), 4), (x1, 1), (torch.randn(9, 4).t(), 9)):
            _call(jfn, _head, *args)
    assert _misses(jfn) == misses and stats.eager_calls == 0, stats.recompile_reasons

    # a static entry at a size the symbolic entry's guards exclude stays
    jfn = fulmen.jit(_head)
    x3 = torch.randn(3, 4).t()
    _call(jfn, _head, x3, 3)  # static: (4, 3)
    _call(jfn, _head, torch.randn(7, 4).t(), 7)  # symbolic: 3 <= size, size != 3
    stats = fulmen.compile_stats(jfn)
    assert len(stats.cache) == 1
    for args in ((x3, 3), (torch.randn(5, 4).t(), 5), (x3, 3)):
        _call(jfn, _head, *args)
    assert _misses(jfn) == 2 and stats.eager_calls == 0, stats.recompile_reasons


def test_a_flow_that_filled_the_cache_now_leaves_room():
    # a training step, an evaluation forward and one with grad mode off, each at length 5
    # (static entries) and then at 7 and 9 (one symbolic entry each, which takes the entry at
    # 5): 3 entries held, not 6, so a limit of 4 leaves room (before: the evaluation at 7
    # ran eagerly, past the limit)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.0),
                                torch.nn.Softmax(-1))
    jmodel = fulmen.jit(model, cache_size_limit=4)
    for length in (5, 7, 9, 5):
        x = torch.randn(2, length, 8)
        model.train()
        jmodel(x).sum().backward()
        model.eval()
        torch.testing.assert_close(jmodel(x), model(x))
        with torch.no_grad():
            torch.testing.assert_close(jmodel(x), model(x))
    stats = fulmen.compile_stats(jmodel)
    assert stats.eager_calls == 0 and stats.cache_misses == 6, stats.recompile_reasons


class _Box:
    """An object argument holding a tensor and an integer (how an HF cache holds them)."""

    def __init__(self, t: torch.Tensor, n: int) -> None:
        self.t = t
        self.n = n


def _variants():
    """Tensors of a few sizes, dtypes, layouts and grads (a leaf with a `.grad`)."""
    found = []
    for shape in ((4, 5), (4, 7), (4, 1), (5, 7), (0, 3)):
        for dtype in (torch.float32, torch.float64):
            base = torch.zeros(shape, dtype=dtype)
            found += [base, torch.zeros(shape[::-1], dtype=dtype).t()]
        graded = torch.zeros(shape, requires_grad=True)
        graded.grad = torch.zeros(shape)
        found += [graded, torch.zeros(shape, requires_grad=True)]
    return found


def _erased_and_masked_keys_agree(calls, symbolic):
    from fulmen.tracer.guards import CacheKeyBuilder
    from fulmen.tracer.subsumed import erased_key

    builder = CacheKeyBuilder()
    keys = []
    for args, kwargs in calls:
        static, _ = builder.key(args, kwargs)
        masked, _ = builder.key(args, kwargs, (), symbolic)
        keys.append((erased_key(static, symbolic, builder.offset_positions), masked))
    equal = 0
    for erased_a, masked_a in keys:
        assert erased_a is not None
        for erased_b, masked_b in keys:
            # equal erased keys: equal keys for the symbolic entry (what dropping relies on)
            # and, the other way round, no call a symbolic entry takes is missed
            assert (erased_a == erased_b) == (masked_a == masked_b)
            equal += erased_a == erased_b
    return equal


def test_erased_static_keys_equal_exactly_where_the_symbolic_keys_do():
    tensors = _variants()
    # positional tensors (the key's fast path), one symbolic dim / free strides
    for symbolic in ({1: (1,)}, {0: (0, 1)}, {0: (1, "strides")}):
        calls = [((a, b), {}) for a in tensors[::6] for b in tensors]
        assert _erased_and_masked_keys_agree(calls, symbolic) > len(calls)
    # keywords, an integer and an object argument's tensor and integer
    # (a tensor with a `.grad` inside an object: the key does not tell whether it is a leaf)
    held = [t for t in tensors if t.grad is None]
    calls = [((a,), {"n": n, "box": _Box(b, m)}) for a in tensors[::2] for b in held[::5]
             for n in (3, 5, 1) for m in (2, 6)]
    symbolic = {0: (1,), 1: "int", (2, (("attr", "t"),)): (1,), (2, (("attr", "n"),)): "int"}
    assert _erased_and_masked_keys_agree(calls, symbolic) > len(calls)
