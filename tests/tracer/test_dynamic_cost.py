"""What a symbolic compilation does not compute: the storage size of a proxy with symbolic
sizes (NOTE [proxy storage size] in `fulmen/proxies/tensor.py`) and PyTorch's source locations
of guards (NOTE [guards without stack summaries] in `fulmen/tracer/symbolic.py`). Each test
checks the work is absent, never how long anything takes; results stay eager's."""

import subprocess
import sys
import textwrap

import torch

from fulmen.proxies import TensorProxy
from fulmen.tracer.symbolic import SymbolicSizes


def _storage_bytes(proxy):
    with torch._C.DisableTorchFunctionSubclass():  # a proxy refuses to answer outside tracing
        return proxy.untyped_storage().nbytes()


def test_a_symbolic_proxy_has_a_plain_storage_size_from_its_hints():
    sizes = SymbolicSizes()
    shape, strides = sizes.symbolize(torch.empty(6, 5, 4), "x", dims=(0, 1))
    assert all(isinstance(size, torch.SymInt) for size in shape[:2])
    proxy = TensorProxy("x", shape, torch.float32, "cpu", strides=strides)
    nbytes = _storage_bytes(proxy)
    assert type(nbytes) is int  # PyTorch's own would be a SymInt expression (sympy per proxy)
    assert nbytes == 6 * 5 * 4 * 4
    # a transposed view with an offset spans its hints' elements from the offset
    view = TensorProxy("v", (shape[1], shape[0]), torch.float16, "cpu",
                       strides=(strides[1], strides[0]), storage_offset=3)
    assert _storage_bytes(view) == (3 + 1 + 4 * 4 + 5 * 20) * 2
    empty = TensorProxy("e", (shape[0], 0), torch.float32, "cpu")
    assert _storage_bytes(empty) == 0


def test_a_static_proxy_keeps_pytorchs_storage_size():
    proxy = TensorProxy("x", (3, 4), torch.float32, "cpu", strides=(1, 3), storage_offset=2)
    assert _storage_bytes(proxy) == (2 + 12) * 4


def test_symbolic_guards_import_no_export_or_inductor():
    """PyTorch's guard locations import torch.export and inductor on the first guard; fulmen's
    ShapeEnv records none, so a symbolic compilation (with guards: `x.shape[0] > 4`) leaves
    them unimported. Run in a fresh interpreter: the test process may have imported them."""
    program = textwrap.dedent("""
        import sys
        import torch
        import fulmen

        def fn(x):
            return x * 2 if x.shape[0] > 4 else x - 1

        jfn = fulmen.jit(fn)
        for n in (5, 6, 7, 9):
            x = torch.randn(n, 3)
            torch.testing.assert_close(jfn(x), fn(x))
        assert fulmen.cache_misses(jfn) == 2, fulmen.cache_misses(jfn)
        print(sorted(m for m in ("torch.export._trace", "torch._inductor.codecache",
                                 "torch._functorch.aot_autograd") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=str(__import__("pathlib").Path(__file__).parents[2]), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
