"""A process forked after codegen compiled kernels can compile new ones (NOTE [fork] in
`fulmen/executors/codegen/build.py`): the child gets compile threads of its own."""

import os
import threading
import time
import warnings

import pytest
import torch

import fulmen
from fulmen.executors.codegen import build as policy
from fulmen.executors.codegen.cpu import compiler as build

EXECUTORS = ["codegen", "torch"]
CHILD_SECONDS = 240  # a kernel compile takes about a second; a hang never ends


def parent_fn(x, y):
    return torch.tanh(x * y + 1.5) - y


def child_fn(x):
    return torch.sigmoid(x * 3.0 - 0.25) * x


def _run_in_child(body) -> int:
    """Fork; the child runs `body()` (True: success) and exits; the child's exit status, or -1
    when it has not finished after CHILD_SECONDS (it is killed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process
        pid = os.fork()
    if pid == 0:
        status = 1
        try:
            status = 0 if body() else 1
        finally:
            os._exit(status)
    deadline = time.monotonic() + CHILD_SECONDS
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -1


@pytest.mark.skipif(not hasattr(os, "fork") or build.compiler() is None,
                    reason="needs fork() and a C++ compiler")
def test_a_forked_child_compiles_a_new_kernel(codegen_eager):
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    jfn = fulmen.jit(parent_fn, executors=EXECUTORS)
    torch.testing.assert_close(jfn(x, y), parent_fn(x, y))  # the compile threads ran

    def child() -> bool:
        jchild = fulmen.jit(child_fn, executors=EXECUTORS)
        trace_ok = torch.allclose(jchild(x), child_fn(x), rtol=1.3e-6, atol=1e-5)
        regions = [b.sym.impl for b in fulmen.last_traces(jchild)[-1].bsyms
                   if hasattr(b.sym.impl, "ready")]
        return trace_ok and bool(regions) and all(r.ready() and not r.failed for r in regions)

    assert _run_in_child(child) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_build_unfinished_at_fork_starts_again_in_the_child():
    release = threading.Event()
    key = ("test", "unfinished at fork")
    running = policy.submit(key, release.wait)
    try:

        def child() -> bool:
            return policy.submit(key, _true).result(timeout=CHILD_SECONDS) is True

        assert _run_in_child(child) == 0
    finally:
        release.set()
    assert running.result(timeout=CHILD_SECONDS) is True


def _true() -> bool:
    return True
