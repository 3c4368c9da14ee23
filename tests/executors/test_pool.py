"""The output pool of the CPU kernels: large outputs reuse memory torch has freed, never memory
anything can still read, and behave as `torch.empty` tensors; large products of two matrices
(`executors/torch/pooled_outputs.py`) run into its blocks with eager's values and gradients."""

import ctypes
import gc
import mmap
import os
import re
import threading
from pathlib import Path

import pytest
import torch

import fulmen
from fulmen.executors.codegen.cpu import pool
from fulmen.executors.torch.pooled_outputs import POOLED_MM

BIG = (1024, 2048)  # 8 MiB of float32: from the pool


@pytest.fixture
def ready(codegen_eager):
    if not pool.ready():
        pytest.skip("no C++ compiler: outputs come from torch.empty")
    pool.empty_cache()
    yield
    pool.empty_cache()


def _huge_pages_enabled() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


def _anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps), in bytes."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        match = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if match:
            mapping = int(match[1], 16) <= address < int(match[2], 16)
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.uint8, torch.bool])
def test_empty_is_a_plain_contiguous_tensor(ready, dtype):
    for shape in [(3, 5), (0,), (), BIG, (2, 1, 3, 1 << 20)]:
        out = pool.empty(shape, dtype)
        assert out.shape == shape and out.dtype == dtype and out.device.type == "cpu"
        assert out.is_contiguous() and out._base is None and not out.requires_grad
        assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
        out.fill_(1)
        assert bool((out == 1).all())


def test_a_freed_block_is_reused_and_a_live_view_keeps_it(ready):
    out = pool.empty(BIG, torch.float32)
    address = out.data_ptr()
    view = out[1:].t()
    del out
    other = pool.empty(BIG, torch.float32)  # the view still holds the first block
    assert other.data_ptr() != address
    del view
    again = pool.empty(BIG, torch.float32)
    assert again.data_ptr() == address
    stats = pool.pool_stats()
    assert stats["in_use"] >= 2 * 8 << 20 and stats["hits"] >= 1


def test_outputs_still_alive_are_never_overwritten(ready):
    def fn(x, i):
        return torch.sin(x) * i + 1

    # nine values of i: nine specialisations, all compiled (the default limit is 8)
    jfn = fulmen.jit(fn, executors=["codegen", "torch"], cache_size_limit=16)
    x = torch.randn(BIG)
    kept = [jfn(x, i) for i in range(4)]
    assert pool.pool_stats()["in_use"] >= 4 * x.nbytes  # the kernel's outputs are pooled
    saved = [y[:, ::2] for y in (jfn(x, i) for i in range(4, 8))]  # only a view survives
    for _ in range(4):
        jfn(x, 100)  # freed at once: its block is reused by the next call
    for i, y in enumerate(kept):
        torch.testing.assert_close(y, fn(x, i))
    for i, v in enumerate(saved, start=4):
        torch.testing.assert_close(v, fn(x, i)[:, ::2])


def test_backward_residuals_keep_their_blocks(ready):
    w = torch.randn(BIG[1], requires_grad=True)
    x = torch.randn(BIG)

    def fn(x, w):
        return (torch.exp(x * w) * torch.sin(x)).sum()

    jfn = fulmen.jit(fn, executors=["codegen", "torch"])
    losses = [jfn(x + i, w) for i in range(3)]  # three graphs alive, residuals from the pool
    for _ in range(3):
        jfn(x, w)
    grads = [torch.autograd.grad(loss, w)[0] for loss in losses]
    for i, grad in enumerate(grads):
        expected = torch.autograd.grad(fn(x + i, w), w)[0]
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-4)


def test_free_from_other_threads(ready):
    outs = [pool.empty(BIG, torch.float32) for _ in range(8)]
    threads = [threading.Thread(target=outs.pop) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gc.collect()
    assert not outs and pool.pool_stats()["cached"] >= 8 * (8 << 20)


def test_limit_and_empty_cache(ready):
    previous = pool.set_pool_limit(16 << 20)
    try:
        outs = [pool.empty(BIG, torch.float32) for _ in range(4)]
        del outs
        assert pool.pool_stats()["cached"] == 16 << 20  # two blocks kept, two released
        pool.empty_cache()
        assert pool.pool_stats()["cached"] == 0
        pool.set_pool_limit(0)  # off: outputs come from torch again (resizable storage)
        out = pool.empty(BIG, torch.float32)
        out.resize_(2048, 2048)
    finally:
        pool.set_pool_limit(previous)


def test_pooled_storage_cannot_grow(ready):
    out = pool.empty(BIG, torch.float32)
    out.resize_(10, 10)  # shrinking keeps the storage
    with pytest.raises(RuntimeError, match="not resizable"):
        out.resize_(4096, 4096)


def test_without_a_compiler_outputs_come_from_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("FULMEN_CACHE_DIR", str(tmp_path))
    state = pool._Pool()
    monkeypatch.setattr(pool, "_state", state)
    assert not pool.ready() and state.failed
    out = pool.empty(BIG, torch.float32)
    out.resize_(2048, 2048)  # torch's own storage
    assert pool.pool_stats()["in_use"] == 0


@pytest.mark.skipif(not _huge_pages_enabled() or pool._madvise is None,
                    reason="transparent huge pages are off here")
def test_large_outputs_get_huge_pages(ready):
    out = pool.empty((4096, 4096), torch.float32)
    out.fill_(2.0)
    huge = _anon_huge_bytes(out.data_ptr() + out.nbytes // 2)
    if huge < 4 << 20 and not _kernel_gives_huge_pages():
        pytest.skip("the kernel has no free huge pages now (memory fragmented)")
    assert huge >= 4 << 20


def _kernel_gives_huge_pages() -> bool:
    """Whether a plain 16 MiB anonymous mapping advised MADV_HUGEPAGE gets huge pages now: a
    control, so the test above fails for the pool's own mistakes only."""
    size = 16 << 20
    block = mmap.mmap(-1, size)
    try:
        block.madvise(mmap.MADV_HUGEPAGE)
        block.write(b"\1" * size)
        view = memoryview(block)
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        found = _anon_huge_bytes(address + size // 2) > 0
        view.release()
        return found
    finally:
        block.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_uses_the_pool(ready):
    pool.empty(BIG, torch.float32)  # freed at once: a free block the child inherits
    pid = os.fork()
    if pid == 0:  # the child: take the inherited block, write it, give it back (small writes:
        code = 3  # an OpenMP region after fork() may never start with GNU OpenMP)
        try:
            out = pool.empty(BIG, torch.float32)
            out[:2, :8] = 1.0
            code = 0 if out[1, 7].item() == 1.0 and pool.pool_stats()["hits"] >= 1 else 4
            del out
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_outputs_under_a_huge_page_are_blocks_of_whole_base_pages(ready):
    """From `MIN_BYTES` (1 MiB) on outputs are pooled (`make demo`'s 2 MiB activations and
    gradients faulted every page each step); under a huge page a block is the output rounded
    up to 4 KiB pages, not to 2 MiB (which would hold up to twice torch.empty's memory)."""
    under = pool.empty((1000, 255), torch.float32)  # 1,020,000 bytes: torch's
    assert under.untyped_storage().resizable() and pool.pool_stats()["in_use"] == 0
    out = pool.empty((1000, 263), torch.float32)  # 1,052,000 bytes: 257 pages of the pool
    assert not out.untyped_storage().resizable()
    assert pool.pool_stats()["in_use"] == 257 * 4096
    address = out.data_ptr()
    del out
    again = pool.empty((1000, 263), torch.float32)
    assert again.data_ptr() == address and pool.pool_stats()["hits"] >= 1


def test_training_steps_never_reuse_a_mid_sized_output_the_user_keeps(ready):
    """A 1.5 MiB activation returned by each step and kept by the user: its block must not go
    to a later step's kernels (whose gradients of the same size are freed and retaken every
    step), and values and gradients are eager's."""
    torch.manual_seed(0)
    w = torch.randn(128, 384, requires_grad=True)

    def step(x, w):
        h = torch.nn.functional.gelu(torch.sin(x) @ w)  # 1024 x 384 float32: 1.5 MiB
        return h, (h * h).sum()

    jfn = fulmen.jit(step, executors=["codegen", "torch"])
    xs = [torch.randn(1024, 128) for _ in range(4)]
    kept, grads = [], []
    for x in xs:
        w.grad = None
        h, loss = jfn(x, w)
        loss.backward()
        kept.append(h.detach())
        grads.append(w.grad)
    assert not kept[0].untyped_storage().resizable()  # a pool block
    assert len({h.data_ptr() for h in kept}) == len(kept)
    for x, h, grad in zip(xs, kept, grads):
        w.grad = None
        expected, loss = step(x, w)
        loss.backward()
        torch.testing.assert_close(h, expected.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, w.grad, rtol=1e-4, atol=1e-3)  # sums of 1024


# --- executors/torch/pooled_outputs.py ------------------------------------------------------


def _statements(jfn, which: int = -1) -> str:
    return str(fulmen.last_traces(jfn)[which])


def _backward_statements(jfn) -> str:
    return str(fulmen.last_backward_traces(jfn)[-1])


def test_a_large_weight_gradient_is_a_pool_block_with_eagers_values(ready):
    # x: 64 x 1024, w: 1024 x 1024: the weight gradient x^T g is 4 MiB, over the pool's threshold
    assert 1024 * 1024 * 4 >= pool.MIN_BYTES
    torch.manual_seed(0)
    x, w = torch.randn(4, 16, 1024), torch.randn(1024, 1024, requires_grad=True)

    def loss(x, w):
        return (x @ w).sum()  # (a backward of products only: eager's bits)

    jfn = fulmen.jit(loss)
    for _ in range(2):  # a second step reuses the block the first step's gradient gave back
        w.grad = None
        jfn(x, w).backward()
        got = w.grad
        w.grad = None
        loss(x, w).backward()
        torch.testing.assert_close(got, w.grad, rtol=0, atol=0)
    assert "torchex.pooled_mm(" in _backward_statements(jfn)
    assert not got.untyped_storage().resizable()  # from the pool, not from torch


def test_small_and_batched_products_keep_eagers_call():
    torch.manual_seed(0)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    jfn = fulmen.jit(lambda a, b: a @ b)
    torch.testing.assert_close(jfn(a, b), a @ b, rtol=0, atol=0)
    assert "pooled_mm" not in _statements(jfn)
    a3 = torch.randn(2, 512, 1024)  # 3-D @ 2-D: the output is 4 MiB, but not of two matrices
    b3 = torch.randn(1024, 1024)
    jfn = fulmen.jit(lambda a, b: a @ b)  # (a new function: static sizes)
    torch.testing.assert_close(jfn(a3, b3), a3 @ b3, rtol=0, atol=0)
    assert "pooled_mm" not in _statements(jfn)


def test_a_large_product_of_transposed_matrices_is_eagers():
    torch.manual_seed(0)
    a, b = torch.randn(512, 1024), torch.randn(1024, 2048)
    jfn = fulmen.jit(lambda a, b: a.t() @ b[:512].t().t() + 1)  # strided operands
    with torch.no_grad():
        torch.testing.assert_close(jfn(a, b), a.t() @ b[:512] + 1, rtol=0, atol=0)
    assert "torchex.pooled_mm(" in _statements(jfn)


def test_under_recorded_grad_the_operator_is_eagers_matmul():
    """`out=` has no autograd: where grad is recorded (a graph-break segment in the caller's
    grad mode) the operator must run `torch.matmul`, or the gradient would be lost (eager
    raises for an `out=` of a tensor requiring grad)."""
    torch.manual_seed(0)
    a, b = torch.randn(8, 4, requires_grad=True), torch.randn(4, 8)
    out = POOLED_MM.impl(a, b)
    assert out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(a.grad, b.sum(1).expand(8, 4))
    with torch.no_grad():
        assert POOLED_MM.impl(a, b).grad_fn is None


def _heads_loss(qkv):
    """litgpt's attention heads: its backward joins the q, k, v gradients with a cat."""
    b, t, c3 = qkv.shape
    q, k, v = qkv.split(c3 // 3, dim=-1)
    q, k, v = [p.reshape(b, t, 4, -1).transpose(1, 2) for p in (q, k, v)]
    return (torch.sin(q) * k + v * v).sum()


def test_the_backwards_large_cat_is_a_pool_block_with_eagers_values(ready):
    """`make demo`'s backward joins the heads' gradients in a 1.5 MiB cat whose fresh output
    faulted its pages every step (0.7 ms of the join's 1.8 ms): it runs into a pool block."""
    torch.manual_seed(0)
    x = torch.randn(8, 128, 384)
    jfn = fulmen.jit(_heads_loss)
    for _ in range(2):
        got = torch.autograd.grad(jfn(x.requires_grad_()), x)[0]
        expected = torch.autograd.grad(_heads_loss(x), x)[0]
        torch.testing.assert_close(got, expected)
        assert got.stride() == expected.stride()
    assert "torchex.pooled_cat(" in _backward_statements(jfn)


def test_a_cat_eager_lays_out_channels_last_keeps_eagers_call(ready):
    x = torch.randn(2, 64, 64, 64).to(memory_format=torch.channels_last)
    jfn = fulmen.jit(lambda a, b: torch.cat([a, b], 1))
    with torch.no_grad():
        got = jfn(x, x + 1)
    expected = torch.cat([x, x + 1], 1)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got.stride() == expected.stride()
    assert "pooled_cat" not in _statements(jfn)


def test_the_pooled_cat_is_eagers_cat_where_grad_is_recorded_or_inputs_differ(ready):
    from fulmen.executors.torch.pooled_outputs import POOLED_CAT

    a = torch.randn(512, 1024, requires_grad=True)
    out = POOLED_CAT.impl([a, a], 0)
    assert out.grad_fn is not None and out.untyped_storage().resizable()
    b = torch.randn(512, 1024)
    torch.testing.assert_close(POOLED_CAT.impl([b, b * 2], -1), torch.cat([b, b * 2], -1),
                               rtol=0, atol=0)
    assert not POOLED_CAT.impl([b, b], 1).untyped_storage().resizable()
    mixed = POOLED_CAT.impl([b, b.double()], 0)  # eager's promotion
    assert mixed.dtype == torch.float64 and mixed.untyped_storage().resizable()
