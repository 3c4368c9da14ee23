"""Per-call host shortcuts of a compiled call (issue 21) are exactly as strict as what they
replace: the reused hash of an optimizer's key (`guards` NOTE [hashed root keys]), the
remembered input-aliasing check (`input_aliasing.AliasingMemo`) and the generated reader of an
object's tensors (`cache_entry.object_reader`). Each test changes what a stale shortcut would
miss and compares with eager PyTorch."""

from __future__ import annotations

import pytest
import torch

import fulmen
from fulmen.tracer.input_aliasing import AliasedInputs, AliasingMemo


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _twins(kind, **options):
    """An optimizer and its jitted step, and an eager twin over equal parameters."""
    mine, theirs = _params(), _params()
    opt, ref = kind(mine, **options), kind(theirs, **options)
    return opt, fulmen.jit(opt.step), ref, mine, theirs


def _same(mine, theirs) -> None:
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_option_changed_after_steps_changes_the_key():
    # the optimizer's key is reused, hashed, while its memo returns the same key: nesterov
    # turned on is a new key (a stale hash would run the plain-momentum program)
    opt, step, ref, mine, theirs = _twins(torch.optim.SGD, lr=0.1, momentum=0.9)
    for _ in range(3):
        step()
        ref.step()
    for group in (*opt.param_groups, *ref.param_groups):
        group["nesterov"] = True
    for _ in range(2):
        step()
        ref.step()
    _same(mine, theirs)
    assert fulmen.compile_stats(step).eager_calls == 0
    assert fulmen.compile_stats(step).cache_misses >= 2


def test_parameter_replaced_in_the_optimizer_is_read():
    # a parameter of the same shape put in place of another: the generated reader follows the
    # paths anew on each call (the new parameter is updated, the old one is left alone)
    opt, step, ref, mine, theirs = _twins(torch.optim.SGD, lr=0.1)
    step()
    ref.step()
    new_mine, new_theirs = _params(1)[0], _params(1)[0]
    old = mine[0].detach().clone()
    opt.param_groups[0]["params"][0] = new_mine
    ref.param_groups[0]["params"][0] = new_theirs
    step()
    ref.step()
    _same([new_mine, mine[1]], [new_theirs, theirs[1]])
    torch.testing.assert_close(mine[0].detach(), old, rtol=0, atol=0)
    assert fulmen.compile_stats(step).eager_calls == 0


def test_grad_replaced_by_another_tensor_of_the_same_shape():
    opt, step, ref, mine, theirs = _twins(torch.optim.AdamW, lr=0.1)
    for i in range(3):
        step()
        ref.step()
        torch.manual_seed(10 + i)
        for a, b in zip(mine, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
    _same(mine, theirs)
    assert fulmen.compile_stats(step).eager_calls == 0


def test_closure_cell_reassigned_to_another_optimizer():
    mine_a, mine_b, theirs_a, theirs_b = _params(0), _params(1), _params(0), _params(1)
    opts = {"a": torch.optim.SGD(mine_a, lr=0.1, momentum=0.9),
            "b": torch.optim.SGD(mine_b, lr=0.1, momentum=0.9)}
    refs = [torch.optim.SGD(theirs_a, lr=0.1, momentum=0.9),
            torch.optim.SGD(theirs_b, lr=0.1, momentum=0.9)]
    opt = opts["a"]

    def step():
        opt.step()

    jstep = fulmen.jit(step)
    for _ in range(2):
        jstep()
        refs[0].step()
    opt = opts["b"]  # the cell now holds the other optimizer  # noqa: F841
    for _ in range(2):
        jstep()
        refs[1].step()
    _same(mine_a + mine_b, theirs_a + theirs_b)
    assert fulmen.compile_stats(jstep).eager_calls == 0


_GLOBAL_OPT = None


def _global_step():
    _GLOBAL_OPT.step()


def test_global_rebound_to_another_optimizer():
    global _GLOBAL_OPT
    mine_a, mine_b, theirs_a, theirs_b = _params(0), _params(1), _params(0), _params(1)
    refs = [torch.optim.AdamW(theirs_a, lr=0.1), torch.optim.AdamW(theirs_b, lr=0.1)]
    jstep = fulmen.jit(_global_step)
    _GLOBAL_OPT = torch.optim.AdamW(mine_a, lr=0.1)
    for _ in range(2):
        jstep()
        refs[0].step()
    _GLOBAL_OPT = torch.optim.AdamW(mine_b, lr=0.1)
    for _ in range(2):
        jstep()
        refs[1].step()
    _GLOBAL_OPT = None
    _same(mine_a + mine_b, theirs_a + theirs_b)
    assert fulmen.compile_stats(jstep).eager_calls == 0


# --- AliasingMemo: the same answer as `check_no_input_aliasing` on every call ---

def test_memo_same_addresses_more_bytes_is_checked_again():
    buf = torch.zeros(8)
    memo = AliasingMemo()
    memo.check([buf[0:2], buf[2:4]], (0,))  # disjoint: remembered
    memo.check([buf[0:2], buf[2:4]], (0,))
    with pytest.raises(AliasedInputs):  # same start addresses, now overlapping
        memo.check([buf[0:3], buf[2:5]], (0,))


def test_memo_non_contiguous_input_is_checked_again():
    buf = torch.zeros(8)
    memo = AliasingMemo()
    memo.check([buf[0:2], buf[2:4]], (0,))
    # the same addresses and byte counts, but the first input's elements 0 and 2 span bytes
    # 0..12, over the second input's first element
    with pytest.raises(AliasedInputs):
        memo.check([buf[0:4:2], buf[2:4]], (0,))


def test_memo_leaves_out_only_fresh_positions():
    buf = torch.zeros(8)
    memo = AliasingMemo()
    memo.check([buf[0:2], buf[2:4], torch.zeros(2)], (0,), [2])
    memo.check([buf[0:2], buf[2:4], torch.zeros(2)], (0,), [2])  # a new copy: still passes
    with pytest.raises(AliasedInputs):
        memo.check([buf[0:3], buf[2:4], torch.zeros(2)], (0,), [2])


def test_two_inputs_made_to_share_storage_on_a_later_call():
    # one symbolic entry serves sizes 2 and 3; the last call's inputs start where the call
    # before's did, with one element more each: they overlap, and it runs as eager does
    def f(a, b):
        a.mul_(2)
        return a + b

    jf = fulmen.jit(f)
    buf, ref = torch.arange(12.0), torch.arange(12.0)
    for (a, b) in [((0, 2), (6, 8)), ((0, 3), (6, 9)), ((0, 2), (6, 8)), ((0, 2), (2, 4)),
                   ((0, 2), (2, 4)), ((0, 3), (2, 5))]:
        got = jf(buf[a[0]:a[1]], buf[b[0]:b[1]])
        torch.testing.assert_close(got, f(ref[a[0]:a[1]], ref[b[0]:b[1]]))
        torch.testing.assert_close(buf, ref)
    assert fulmen.compile_stats(jf).cache_hits >= 3  # (one symbolic entry: its memo)


# --- a compile pass's own bug is raised under the test suite's FULMEN_CHECK=1 ---

def test_pass_bug_under_symbolic_floats_is_raised_in_tests(monkeypatch):
    # a pass that fails (TypeError: a bug, not a FulmenError refusal) only once floats are read
    # at run time: the fallback to constants hid it as a recompile; the test settings raise it
    from fulmen import jitted
    from fulmen.transforms.base import transform

    @transform("fails on run-time floats")
    def fails_on_floats(trace):
        if len(trace.args) == 2:  # `s` read at run time (a float64 carrier), `x`
            raise TypeError("planted pass bug")
        return trace

    monkeypatch.setattr(jitted, "CHECK_SOURCE", True)
    jf = fulmen.jit(lambda x, s: x * s, transforms=[fails_on_floats])
    x = torch.randn(3)
    with pytest.raises(TypeError, match="planted pass bug"):
        for s in (0.5, 0.25, 0.125, 2.0):
            torch.testing.assert_close(jf(x, s), x * s)
    monkeypatch.setattr(jitted, "CHECK_SOURCE", False)  # users: the fallback stays
    jf = fulmen.jit(lambda x, s: x * s, transforms=[fails_on_floats])
    for s in (0.5, 0.25, 0.125, 2.0):
        torch.testing.assert_close(jf(x, s), x * s)


# --- RootsMemo: the same roots as `function_roots` after every change it must see ---

class _Holder:
    pass


class _CallableHolder:
    def __call__(self):
        return None


_MEMO_GLOBAL = _Holder()


_MEMO_OTHER = _Holder()


def _other_code():
    inner = None

    def other():
        return inner, _MEMO_OTHER

    return other.__code__


def _roots_case():
    import weakref

    first, target = _Holder(), _Holder()
    ref = weakref.ref(target)

    def inner():
        return first, ref

    def fn():
        return inner(), _MEMO_GLOBAL

    def set_first(value):
        nonlocal first
        first = value

    def set_ref(value):
        nonlocal ref
        ref = value

    return fn, set_first, set_ref, target


def test_roots_memo_sees_every_rebinding():
    global _MEMO_GLOBAL
    import weakref

    from fulmen.tracer.key_memo import RootsMemo
    from fulmen.tracer.objects import function_roots

    fn, set_first, set_ref, target = _roots_case()
    memo = RootsMemo()

    def same():
        got, want = memo.roots(fn), function_roots(fn)
        assert [id(r) for r in got] == [id(r) for r in want]
        assert [id(r) for r in memo.roots(fn)] == [id(r) for r in want]  # (from the memo)
        return want

    saved = _MEMO_GLOBAL
    try:
        assert len(same()) == 3
        set_first(_Holder())  # a closure cell of a nested function reassigned
        same()
        other = _Holder()
        set_ref(weakref.ref(other))  # a weak reference to another object
        assert other in same()
        del other  # the referent dies (no memo holds it): the weak reference answers None
        assert len(same()) == 2
        set_ref(weakref.ref(target))
        set_ref(None)  # (weak references are never remembered: the rest is)
        same()
        assert memo._fn is fn
        _MEMO_GLOBAL = _Holder()  # a rebound global
        assert _MEMO_GLOBAL in same()
        _MEMO_GLOBAL.__class__ = _CallableHolder  # now callable: no root
        assert _MEMO_GLOBAL not in same()
        _MEMO_GLOBAL.__class__ = _Holder
        assert _MEMO_GLOBAL in same()
        fn.__code__ = _other_code()  # reads another global
        roots = same()
        assert _MEMO_OTHER in roots and _MEMO_GLOBAL not in roots
    finally:
        _MEMO_GLOBAL = saved
