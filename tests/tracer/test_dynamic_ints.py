"""Integer arguments and integers held by an object argument (an HF cache layer's
`cumulative_length`) that change between calls are traced as symbols
(`SymbolicSizes.symbolize_int`), which user code's `isinstance` and `str` see as numbers
(`fulmen.tracer.int_answers`, `fulmen.tracer.formatting`). Every call of a sequence of changing values, including values that cross
a guard, 0 and 1 (specialised) and negative numbers (constants), equals eager, and the
compilations stay few."""

import builtins
import sys
import warnings

import pytest
import torch

import fulmen
from fulmen.tracer import int_answers

# values crossing `n > 4`, the slice bound of a width of 12, 0, 1 and negative numbers
VALUES = (2, 3, 5, 6, 4, 7, 10, 3, 1, 0, 12, 8, -2, 9, 13, 5)


class _Box:
    """An object argument holding the integer (how a cache holds its counters)."""

    def __init__(self, n: int) -> None:
        self.n = n


def _same(want, got) -> bool:
    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and want.dtype == got.dtype
                and want.shape == got.shape and torch.equal(want, got))
    if isinstance(want, (tuple, list)):
        return type(want) is type(got) and len(want) == len(got) and all(
            _same(a, b) for a, b in zip(want, got))
    return type(want) is type(got) and want == got


def _branches(x, box):
    n = box.n
    if n > 4:  # a guard on the symbol
        y = x[:, -n:] + n
    else:
        y = x[:, :n] * n
    return y, torch.arange(n + 3), x.sum(1) + n


@pytest.mark.parametrize("values", [VALUES, tuple(reversed(VALUES))])
def test_an_object_int_in_branches_slices_arithmetic_and_arange_equals_eager(values):
    jfn = fulmen.jit(_branches, cache_size_limit=64)
    x = torch.randn(3, 12)
    for n in values:
        assert _same(_branches(x, _Box(n)), jfn(x, _Box(n))), n
    stats = fulmen.compile_stats(jfn)
    # one entry per side of `n > 4` and of the slice bound, plus 0, 1 and -2 as constants
    # (every distinct value compiled before: 12)
    assert stats.cache_misses <= 8 and stats.eager_calls == 0, stats.recompile_reasons


class _Counter:
    def __init__(self) -> None:
        self.seen = 0
        self.calls = 0
        self.big = False


def _count(x, counter):
    counter.seen += x.shape[0]  # a symbolic size plus a symbolic int, stored
    counter.calls += 1
    counter.big = counter.seen > 20  # a traced bool, stored
    return x * counter.calls


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_counter_object_equals_eager_after_every_call(dynamic):
    jfn = fulmen.jit(_count, dynamic=dynamic)
    want, got = _Counter(), _Counter()
    for size in (3, 5, 7, 2, 9, 4, 6, 3, 8, 5):
        x = torch.randn(size, 2)
        assert _same(_count(x, want), jfn(x, got))
        assert (type(got.seen), got.seen, type(got.calls), got.calls, type(got.big), got.big) \
            == (int, want.seen, int, want.calls, bool, want.big)
    stats = fulmen.compile_stats(jfn)
    # the first call, calls == 1 (specialised), the symbolic entry, big turning True
    assert stats.cache_misses <= 4 and stats.eager_calls == 0, stats.recompile_reasons


class _Window:
    def __init__(self) -> None:
        self.length = 0
        self.window = 6


def _attend(keys, cache):
    cache.length += keys.shape[0]
    if cache.length >= cache.window:  # `is_full` of HF's sliding-window layer
        offset = cache.length - cache.window + 1
    else:
        offset = 0
    return keys[-min(cache.length, cache.window):] * 2, torch.arange(offset, cache.length)


def test_an_object_int_across_a_guard_equals_eager():
    """The decode loop of a sliding-window cache: the int grows past the window (a new guard
    answer, compiled once more), and every step equals eager."""
    jfn = fulmen.jit(_attend)
    want, got = _Window(), _Window()
    for _ in range(12):
        keys = torch.randn(3, 2)
        assert _same(_attend(keys, want), jfn(keys, got))
        assert type(got.length) is int and got.length == want.length
    stats = fulmen.compile_stats(jfn)
    assert stats.cache_misses <= 4 and stats.eager_calls == 0, stats.recompile_reasons


def _with_break(x, box):
    n = box.n
    y = x * n
    if y.sum() > 0:  # a graph break: the later segment reads `n` only as a size
        return torch.arange(n) + 1
    return torch.arange(n) - 1


def test_a_symbolic_int_used_after_a_graph_break_equals_eager():
    jfn = fulmen.jit(_with_break)
    for n, sign in [(2, 1), (3, 1), (5, -1), (7, 1), (4, -1), (9, 1)]:
        x = torch.full((3,), float(sign))
        assert _same(_with_break(x, _Box(n)), jfn(x, _Box(n))), n
    stats = fulmen.compile_stats(jfn)
    assert stats.cache_misses <= 2 and stats.eager_calls == 0, stats.recompile_reasons


def _returns_numbers(x, box):
    return x + 1, box.n + 1, box.n / 2


def test_traced_numbers_returned_are_the_calls():
    jfn = fulmen.jit(_returns_numbers)
    x = torch.ones(2)
    for n in (2, 3, 8, 5, 11):
        assert _same(_returns_numbers(x, _Box(n)), jfn(x, _Box(n))), n


def _specialises(x, box):
    return sum(x for _ in range(box.n))  # range() needs the number itself


def test_an_int_python_specialises_is_guarded_by_value():
    jfn = fulmen.jit(_specialises)
    x = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # past the cache size limit: eagerly, correctly
        for n in (2, 3, 4, 5, 3, 2, 6, 7, 8, 9, 10, 2):
            assert _same(_specialises(x, _Box(n)), jfn(x, _Box(n))), n


def _scaled_head(x, box):
    n = box.n
    return (x[:n] * n).sum() + (x * x / n).sum()


def test_gradients_through_a_symbolic_int_equal_eager():
    """The backward uses the symbol (`/ n`, the slice's padding) but reads no tensor holding
    it: the carrier becomes a residual."""
    jfn = fulmen.jit(_scaled_head)
    for n in (2, 3, 5, 7, 4, 9):
        x = torch.randn(10, 3, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        want, got = _scaled_head(x, _Box(n)), jfn(x2, _Box(n))
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(x2.grad, x.grad)
    stats = fulmen.compile_stats(jfn)
    assert stats.cache_misses <= 2 and stats.eager_calls == 0, stats.recompile_reasons


def _compare(x, box):
    return x + (box.n > 10), box.n // 3


def test_ints_no_carrier_holds_stay_constants():
    """A carrier is an empty tensor of shape (0, n): integers past 2**62 are guarded out of the
    symbolic entry and compiled as constants (an empty tensor that large cannot be made)."""
    jfn = fulmen.jit(_compare)
    x = torch.ones(2)
    for n in (2, 3, 5, 2**70, 7, 2**62, 2**62 + 1, 2**63 + 5, 11):
        assert _same(_compare(x, _Box(n)), jfn(x, _Box(n))), n
    assert fulmen.compile_stats(jfn).eager_calls == 0


def _formats(x, n):
    scale = 1.0 if isinstance(n, int) else -1.0
    return x * scale + len(str(n)) + len(f"<{n}>"), x[:, :n].sum()


def test_plain_int_arguments_are_numbers_to_python():
    """`isinstance(n, int)` and `str(n)` of a symbol would answer differently from eager with no
    guard (the symbol's name has 2 characters where 12 has 2 and 5 has 1): traced as a symbol,
    an int argument answers both as its number (`str` with a guard on the number's length),
    every call equal to eager."""
    jfn = fulmen.jit(_formats, cache_size_limit=16)
    x = torch.randn(2, 12)
    for n in (3, 5, 12, 7, 10, 4, 11):  # (a fused kernel may round x * 1 + 4 once)
        torch.testing.assert_close(jfn(x, n), _formats(x, n), msg=str(n))
    assert fulmen.compile_stats(jfn).eager_calls == 0


def _decode_step(x, positions, limit):
    """litgpt's decoding call: `input_pos_maxp1` slices the mask and the cache."""
    return (x[:, :limit] * positions[None, :limit]).sum(1)


def _keep_logits(hidden, logits_to_keep):
    """HF's `slice_logits_to_keep`: an int keeps the last positions, a tensor indexes them."""
    index = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, index, :] * 2


def test_an_int_argument_that_varies_is_traced_once_as_a_symbol():
    """litgpt's `generate` passes `input_pos_maxp1` growing by one per token, HF's assisted
    decoding a `logits_to_keep` that varies: each value compiled anew (eager after the cache
    limit); now the second value compiles a symbolic entry that serves the rest."""
    jdecode, jkeep = fulmen.jit(_decode_step), fulmen.jit(_keep_logits)
    positions = torch.arange(40.0)
    for limit in range(6, 30):
        x = torch.randn(3, 40)
        torch.testing.assert_close(jdecode(x, positions, limit), _decode_step(x, positions, limit))
        hidden = torch.randn(2, 30, 4)
        torch.testing.assert_close(jkeep(hidden, limit), _keep_logits(hidden, limit))
    for jitted in (jdecode, jkeep):
        stats = fulmen.compile_stats(jitted)
        assert stats.cache_misses == 2 and stats.eager_calls == 0


def _size_kind(x):
    return x * 2 if isinstance(x.shape[1], int) else x * 3


def test_user_code_asking_whether_a_symbolic_size_is_an_int_gets_eagers_answer():
    jfn = fulmen.jit(_size_kind, dynamic=True)
    for n in (3, 5, 8):
        x = torch.randn(2, n)
        torch.testing.assert_close(jfn(x), _size_kind(x))
    assert builtins.isinstance.__module__ == "builtins"  # put back after the traces
    # and the internal modules given the builtin as a global of theirs while tracing lose it
    # (NOTE [internal modules keep the builtin isinstance])
    for name in int_answers._KEEP_BUILTIN:
        assert "isinstance" not in vars(sys.modules[name]), name


def _formats_sizes(x, box):
    return (x + len(str(box.n)) + len(f"<{box.n}>") + len(f"{x.shape[0]}")
            + len("%s" % x.shape[0]) + len(format(box.n, "04d")))  # noqa: UP031


def _reprs(x, n):
    return x + len(repr(n)) + len(f"{x.shape[0]!r}")


def test_reprs_of_sizes_and_ints_from_user_code_are_their_numbers():
    jfn = fulmen.jit(_reprs, cache_size_limit=16)
    for n in (3, 12, 5, 100, 7):
        x = torch.zeros(n)
        torch.testing.assert_close(jfn(x, n), _reprs(x, n), msg=str(n))


def test_sizes_and_ints_formatted_by_user_code_are_their_numbers():
    """A symbolic size or int formatted by user code (`str`, f-strings, `%`, `format` with a
    spec) gives its number and is guarded by it (it gave the symbol's name, `s0`: a string of
    another length, silently)."""
    jfn = fulmen.jit(_formats_sizes, cache_size_limit=16)
    for n in (3, 5, 12, 7, 100, 4, 11, 9):
        x = torch.zeros(n)
        torch.testing.assert_close(jfn(x, _Box(n)), _formats_sizes(x, _Box(n)), msg=str(n))
    assert fulmen.compile_stats(jfn).eager_calls == 0


def _two_kinds(x, scale=None, box=None):
    y = x[:, :box.n]
    return y * scale if scale is not None else y + box.n


def test_an_int_varying_across_calls_of_alternating_structures_is_traced_once_as_a_symbol():
    """Two kinds of call alternate (HF classifier-free guidance: the model's decoding step with
    `position_ids`, then the unconditional one without, each with a cache whose counter grows);
    the object's integer sits at another argument position in each kind. It is named by its
    path (`box.n`), as a tensor's sizes are, so it goes symbolic once per kind; compared only
    with the last call of the same positions it never did, and every call compiled (past
    `cache_size_limit`, eagerly)."""
    jfn = fulmen.jit(_two_kinds)
    x, scale = torch.randn(2, 16), torch.randn(1)
    for n in range(2, 14):
        assert _same(_two_kinds(x, scale, _Box(n)), jfn(x, scale, box=_Box(n))), n
        assert _same(_two_kinds(x, box=_Box(n)), jfn(x, box=_Box(n))), n
    stats = fulmen.compile_stats(jfn)
    assert stats.cache_misses <= 4 and stats.eager_calls == 0, stats.recompile_reasons


@pytest.mark.parametrize("op", [
    lambda x, d, s: x.flip(d, 0), lambda x, d, s: x.permute(d, 0, 5 - d, 1),
    lambda x, d, s: x.roll(s, d), lambda x, d, s: x.unsqueeze(d).squeeze((d, 0)),
    lambda x, d, s: x.roll(s)], ids=["flip", "permute", "roll", "squeeze", "roll_flat"])
def test_dims_and_shifts_given_as_varying_ints_are_eagers(monkeypatch, op):
    """A dim given as an int argument that changes between calls is traced as a symbol and
    then specialised with a guard (which dim decides the trace's shapes); a shift may stay
    symbolic. Wrapping the symbolic dim modulo the rank built an unhashable symbolic
    expression (flip/permute/squeeze), and `roll` refused a symbolic shift or dim: both raised
    under `FULMEN_DYNAMIC=strict` (found by its op_db run) and fell back to a static trace per
    call otherwise."""
    monkeypatch.setenv("FULMEN_DYNAMIC", "strict")  # symbolic, raising where a trace fails
    fn = lambda x, d, s: op(x, d, s) * 2  # noqa: E731
    jfn = fulmen.jit(fn)
    x = torch.randn(1, 2, 3, 4)
    for d, s in ((2, 2), (3, 5), (2, 7), (3, 3), (2, 2)):  # 0 and 1 would be specialised
        torch.testing.assert_close(jfn(x, d, s), fn(x, d, s), msg=f"dim {d} shift {s}")
