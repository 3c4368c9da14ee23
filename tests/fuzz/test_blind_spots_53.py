"""Blind spots of the mutant table found in session 53 (h53mut): behaviours no test of `make
test` pinned, each compared with eager (or with what the policy documents). Each test kills
one or more rows under `# --- session 53, h53mut` in `tests/fuzz/mutant_table.py`."""

import contextlib
import io
import threading

import pytest
import torch

import fulmen

# --- tracer/slice_bounds.py: slices bounded by 0-d integer tensors -----------------------


def _start(x, n):
    return x[n:] * 2


def _step(x, n):
    return x[::n] + 1


def _stop_alone(x, n):
    return x[:n].sum(0)


def _second_dim(x, n):
    out = x.clone()
    out[:, n:] = 0.0
    return out


@pytest.mark.parametrize("fn", [_start, _step, _stop_alone, _second_dim])
def test_every_bound_of_a_slice_may_be_a_zero_dim_tensor(fn):
    """`x[n:]`, `x[::n]`, `x[:n]` (an index that is no tuple) and a write `x[:, n:] = 0`, with
    `n` a 0-d integer tensor, compiled (no eager call) and equal to eager for each `n`."""
    jfn = fulmen.jit(fn)
    x = torch.randn(7, 5)
    for k in (2, 3, 2):
        n = torch.tensor(k)
        torch.testing.assert_close(jfn(x, n), fn(x, n))
    assert fulmen.compile_stats(jfn).eager_calls == 0


# --- tracer/host_output.py: prints while tracing -----------------------------------------


def _ticks(x):
    print("tick", end="")
    return x + 1


def test_a_print_with_no_line_end_prints_on_every_call():
    """`print("tick", end="")` ends by writing "": the trace printed all the same, so every
    call runs eagerly and prints, as eager does."""
    jfn = fulmen.jit(_ticks)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        for _ in range(3):
            torch.testing.assert_close(jfn(torch.ones(2)), torch.ones(2) + 1)
    assert text.getvalue() == "tick" * 3


def _prints_from_a_thread(x):
    worker = threading.Thread(target=lambda: print("from a thread"))
    worker.start()
    worker.join()
    return x * 2


def test_another_threads_print_while_tracing_passes_through():
    """A print of another thread while the function traces is that thread's, not the trace's:
    it reaches the stream and the trace stays compiled."""
    jfn = fulmen.jit(_prints_from_a_thread)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        torch.testing.assert_close(jfn(torch.ones(2)), torch.ones(2) * 2)
    assert text.getvalue() == "from a thread\n"
    assert fulmen.compile_stats(jfn).eager_calls == 0


def test_stdout_is_given_back_after_tracing():
    """After a compiled call (traced or refused for its print), `print` reaches the stream."""
    for fn in (_ticks, lambda x: x - 1):
        jfn = fulmen.jit(fn)
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            jfn(torch.ones(2))
            print("after")
        assert text.getvalue().endswith("after\n")
