"""NumPy arrays and Python data a compiled program reads: as arguments, globals or after a graph
break (`.numpy()`). The program bakes in what it computes from an array, so the cache key holds
each array by identity and by value (`tracer/sources.py` `array_key`); a tensor made from a list
inside the function is made anew by every call (`tracer/factory_mode.py` `_DATA_FACTORIES`)."""

import sys

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

import fulmen

TABLE = np.array([1.0, 2.0])


def _scaled_by_array(x, a):
    return x * torch.from_numpy(a * 2), x * float(a.sum())


def test_an_array_argument_changed_in_place_is_not_stale():
    jfn, x, a = fulmen.jit(_scaled_by_array), torch.ones(2, dtype=torch.float64), np.ones(2)
    jfn(x, a)
    a[0] = 7.0
    for got, want in zip(jfn(x, a), _scaled_by_array(x, a)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_new_array_each_call_gives_its_own_answer():
    # a loader's fresh arrays: a freed array's id is reused by the next one
    jfn, x = fulmen.jit(_scaled_by_array), torch.ones(2, dtype=torch.float64)
    for step in range(4):
        a = np.array([float(step), 1.0])
        for got, want in zip(jfn(x, a), _scaled_by_array(x, a)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        del a


def _scaled_by_table(x):
    return x * torch.from_numpy(TABLE * 2) + float(TABLE[0])


def test_a_global_array_changed_in_place_is_not_stale():
    jfn, x = fulmen.jit(_scaled_by_table), torch.ones(2, dtype=torch.float64)
    try:
        jfn(x)
        TABLE[0] = 5.0
        torch.testing.assert_close(jfn(x), _scaled_by_table(x), rtol=0, atol=0)
    finally:
        TABLE[:] = [1.0, 2.0]


def _through_numpy(x):
    a = x.detach().numpy()  # a graph break
    return x * float(np.mean(a)), torch.from_numpy(a * 2)


def test_a_tensor_made_from_numpy_after_a_break_is_returned():
    jfn = fulmen.jit(_through_numpy)
    for _ in range(2):
        x = torch.randn(3, requires_grad=True)
        got, want = jfn(x), _through_numpy(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        got[0].sum().backward()
        want_grad = x.grad.clone()
        x.grad = None
        want[0].sum().backward()
        torch.testing.assert_close(want_grad, x.grad)


BUFFER = np.ones(2)


def _from_python_data(x):
    t = torch.as_tensor([1.0, 2.0])
    t.add_(x)  # a new tensor each call: the update does not carry over
    u = torch.asarray([[0.0, 0.0]])
    u += x
    shared = torch.as_tensor(BUFFER)  # shares the global array's memory: updates it
    shared.mul_(2)
    return t * 1, u.clone(), x * shared


def test_a_tensor_made_from_a_list_is_new_each_call():
    jfn = fulmen.jit(_from_python_data)
    try:
        for _ in range(3):
            x = torch.ones(2, dtype=torch.float64)
            BUFFER[:] = 1.0
            got = jfn(x)
            after = BUFFER.copy()
            BUFFER[:] = 1.0
            want = _from_python_data(x)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert (after == BUFFER).all()
    finally:
        BUFFER[:] = 1.0


@pytest.mark.parametrize("make", [
    lambda: torch.from_numpy(np.ones(3, dtype=np.float32)),
    lambda: torch.frombuffer(bytearray(np.ones(3, dtype=np.float32).tobytes()),
                             dtype=torch.float32),
], ids=["from_numpy", "frombuffer"])
def test_a_tensor_made_by_an_untraced_constructor_is_new_each_call(make):
    def fn(x):
        return make().add_(x)

    jfn = fulmen.jit(fn)
    for _ in range(3):
        x = torch.arange(3.0)
        torch.testing.assert_close(jfn(x), fn(x), rtol=0, atol=0)



def _made_then_updated_across_a_break(x):
    t = torch.Tensor([1.0, 2.0, 3.0])
    t.add_(x)
    if x.sum() > 0:  # a graph break: the update goes on in the next segment
        t.mul_(2)
    return t


def _from_numpy_updated_across_a_break(x):
    t = torch.from_numpy(np.ones(3, dtype=np.float32))
    t.add_(x)
    if x.sum() > 0:
        t.mul_(2)
    return t


def _frombuffer_by_keyword(x):
    return torch.frombuffer(buffer=bytearray(12), dtype=torch.float32).add_(x)


def _strided_array(x):
    return torch.from_numpy(np.ones((3, 6), dtype=np.float32)[:, ::2]).add_(x)


def _kept_by_a_frame(x):
    t = torch.Tensor([1.0, 2.0, 3.0])
    t.add_(x)
    frame = sys._getframe()  # the finished call's frame outlives it while `frame` holds it
    return t, frame.f_lineno > 0


@pytest.mark.parametrize("fn", [_made_then_updated_across_a_break,
                                _from_numpy_updated_across_a_break, _frombuffer_by_keyword,
                                _strided_array, _kept_by_a_frame],
                         ids=["across_break", "from_numpy_across_break", "frombuffer_keyword",
                              "strided", "frame"])
def test_a_tensor_the_call_makes_is_new_each_call_with_eagers_layout(fn):
    """NOTE [tensors made during the call]: a tensor made from data no torch function sees is
    new in each eager call. Updated on both sides of a graph break, the compiled segments
    updated one tensor kept from the trace (the trace tree ignored which captured tensors
    are the call's own): 2, 6, 10, then 4, 14, 24 from the second call on. Also a buffer
    given by keyword, an array with strides (kept by the copy), a frame holding the tensor."""
    jfn = fulmen.jit(fn)
    for _ in range(3):
        x = torch.arange(3.0)
        expected, actual = fn(x), jfn(x)
        for e, a in zip(pytree.tree_leaves(expected), pytree.tree_leaves(actual), strict=True):
            if isinstance(e, torch.Tensor):
                assert torch.equal(a, e) and a.stride() == e.stride()
            else:
                assert a == e


def test_a_parameter_the_call_makes_is_returned_as_eagers():
    """`nn.Parameter(torch.Tensor(...))` reaches no torch function: the parameter the call
    makes is captured, and each call returns a new copy of it, which is a Parameter requiring
    grad as eager's (it came back a plain tensor: `module.weight = make()` then raised)."""
    def make(x):
        return torch.nn.Parameter(torch.Tensor([1.0, 2.0, 3.0])), x + 1

    jmake = fulmen.jit(make)
    returned = []
    for _ in range(2):
        x = torch.arange(3.0)
        (expected, _), (actual, _) = make(x), jmake(x)
        assert type(actual) is type(expected) and actual.requires_grad == expected.requires_grad
        assert torch.equal(actual.detach(), expected.detach())
        returned.append(actual)
    assert returned[0] is not returned[1]


SHARED = np.zeros(4, dtype=np.float32)


def _into_shared(x):
    return torch.from_numpy(SHARED).add_(x)


def _into_shared_view(x):
    return torch.from_numpy(SHARED[1:]).add_(x[1:])


def _into_argument(x, a):
    return torch.from_numpy(a).add_(x)


def _into_fresh_view(x):
    return torch.from_numpy(np.ones(8, dtype=np.float32).reshape(2, 4)[1]).add_(x)


@pytest.mark.parametrize("fn", [_into_shared, _into_shared_view, _into_fresh_view],
                         ids=["global", "view_of_global", "view_of_fresh"])
def test_a_tensor_over_an_arrays_memory_updates_it_as_eager_does(fn):
    # NOTE [tensors made during the call]: only an array no one else holds is the call's own;
    # a global's (or a view of it) is updated by every call, in eager and compiled alike
    jfn = fulmen.jit(fn)
    try:
        for _ in range(3):
            x = torch.arange(4.0)
            before = SHARED.copy()
            got = jfn(x).clone()
            after = SHARED.copy()
            SHARED[:] = before
            torch.testing.assert_close(got, fn(x), rtol=0, atol=0)
            assert (after == SHARED).all()
    finally:
        SHARED[:] = 0.0


def test_a_tensor_over_an_array_argument_updates_the_argument():
    jfn = fulmen.jit(_into_argument)
    a, b = np.zeros(4, dtype=np.float32), np.zeros(4, dtype=np.float32)
    for _ in range(3):
        x = torch.arange(4.0)
        torch.testing.assert_close(jfn(x, a), _into_argument(x, b), rtol=0, atol=0)
        assert (a == b).all()


GLOBAL_COUNT = torch.zeros(3)
GLOBAL_LIST = [torch.zeros(3)]


def test_a_tensor_made_by_the_legacy_constructor_is_new_each_call():
    # NOTE [tensors made during the call]: `torch.Tensor(list)` reaches no TorchFunctionMode;
    # its tensor was captured once, so each call updated and returned the same one
    def update(x):
        return torch.Tensor([1.0, 1.0, 1.0]).add_(x)

    def fresh(x):
        return x * 2, torch.Tensor([3.0, 4.0, 5.0])

    jupdate, jfresh = fulmen.jit(update), fulmen.jit(fresh)
    returned = []
    for _ in range(3):
        x = torch.arange(3.0)
        torch.testing.assert_close(jupdate(x), update(x), rtol=0, atol=0)
        got = jfresh(x)
        torch.testing.assert_close(got, fresh(x), rtol=0, atol=0)
        got[1].mul_(10)  # the caller's edit of one call's tensor reaches no other call
        returned.append(got[1])
    assert len({id(t) for t in returned}) == 3


def test_global_tensors_updated_in_place_keep_their_updates():
    # the tensors a trace captures that something outside refers to are globals: updated
    # in place, the update persists as in eager (a cell, a module namespace, a list)
    cell = torch.zeros(3)

    def step(x):
        cell.add_(x)
        GLOBAL_COUNT.add_(x)
        GLOBAL_LIST[0].add_(x)
        return x * 1

    jstep = fulmen.jit(step)
    try:
        for _ in range(3):
            jstep(torch.ones(3))
        for t in (cell, GLOBAL_COUNT, GLOBAL_LIST[0]):
            torch.testing.assert_close(t, torch.full((3,), 3.0))
    finally:
        GLOBAL_COUNT.zero_()
        GLOBAL_LIST[0].zero_()


def _from_sizes(x, scale: float):
    return x * torch.as_tensor([x.shape[0], scale]).sum()


def test_a_tensor_made_from_symbolic_numbers_is_recorded_not_specialised():
    """`torch.as_tensor([x.shape[0], scale])` is recorded as an op on the symbolic numbers, so
    new sizes and scales do not retrace (run at trace time it would guard on each value)."""
    jfn = fulmen.jit(_from_sizes, dynamic=True)
    for n, scale in [(3, 1.5), (4, 2.5), (5, 0.5), (7, 3.0)]:
        x = torch.randn(n, dtype=torch.float64)
        torch.testing.assert_close(jfn(x, scale), _from_sizes(x, scale), rtol=0, atol=0)
    assert fulmen.cache_misses(jfn) <= 2
