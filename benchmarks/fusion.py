"""Fusion benchmark (CPU): eager vs fulmen (torch executor) vs fulmen (codegen) vs torch.compile.

    .venv/bin/python benchmarks/fusion.py [--sizes 256,1024,2048] [--repeats 20]

Workloads: a 10-op elementwise chain, and a softmax-like pattern whose max/sum reductions stay
with torch while the pointwise parts around them are fused. Prints one markdown table: median
time per call, speedup over eager, and the first call's time (trace + compile; codegen kernels
compile into a fresh temporary FULMEN_CACHE_DIR, so this is a cold compile).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def chain(x, y, b):
    t = x * y + b
    t = torch.tanh(t) * 0.5 + x
    t = torch.sigmoid(t) - y
    t = torch.exp(-t * t) + b
    return torch.maximum(t, x) / 3.0


def softmax_like(x, b):
    z = (x + b) * 0.125
    m = z.amax(dim=-1, keepdim=True)
    e = torch.exp(z - m)
    return e / e.sum(dim=-1, keepdim=True)


def _time(fn, args, repeats):
    start = time.perf_counter()
    fn(*args)
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times), first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="256,1024,2048")
    parser.add_argument("--repeats", type=int, default=20)
    opts = parser.parse_args()
    os.environ["FULMEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="fulmen-bench-")
    import fulmen

    rows = ["| workload | size | variant | median ms | vs eager | first call ms |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, fn in (("10-op chain", chain), ("softmax-like", softmax_like)):
        for n in (int(s) for s in opts.sizes.split(",")):
            x, y, b = torch.randn(n, n), torch.randn(n, n), torch.randn(n)
            args = (x, y, b) if fn is chain else (x, b)
            expected = fn(*args)
            variants = {
                "eager": fn,
                "fulmen torch": fulmen.jit(fn, executors=["torch"]),
                "fulmen codegen": fulmen.jit(fn, executors=["codegen", "torch"]),
                "torch.compile": torch.compile(fn),
            }
            eager_ms = None
            for variant, vfn in variants.items():
                median, first = _time(vfn, args, opts.repeats)
                torch.testing.assert_close(vfn(*args), expected, rtol=1e-5, atol=1e-5)
                eager_ms = eager_ms or median * 1e3
                rows.append(f"| {name} | {n}x{n} | {variant} | {median * 1e3:.3f} | "
                            f"{eager_ms / (median * 1e3):.2f}x | {first * 1e3:.0f} |")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
