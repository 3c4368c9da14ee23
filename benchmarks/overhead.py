"""Per-call overhead: a 10-op elementwise function on 8x8 tensors.

Measures eager, fulmen.jit (torch executor) and torch.compile in one run and prints a markdown
table with microseconds per call and the difference to eager. Run: `make bench`.
"""

from __future__ import annotations

import argparse
import platform
import timeit

import torch

import fulmen


def ten_ops(x, y):
    a = x + y
    b = a * x
    c = b - y
    d = torch.sin(c)
    e = d * 2.0
    f = torch.exp(e)
    g = f / (y + 3.0)
    h = torch.tanh(g)
    return h + a


def warm_up(fn, args, calls: int = 5) -> None:
    """Call `fn` until its codegen regions are hot and wait for their kernels (the default lazy
    policy compiles them in the background), so timing sees the steady state."""
    for _ in range(calls):
        fn(*args)
    try:
        traces = [*fulmen.last_traces(fn)[-1:], *fulmen.last_backward_traces(fn)[-1:]]
    except Exception:  # not a jitted function
        return
    from fulmen.executors.codegen import wait_for_kernels

    wait_for_kernels(*traces)


def per_call_us(fn, args, number: int, repeat: int) -> float:
    warm_up(fn, args)
    times = timeit.repeat(lambda: fn(*args), number=number, repeat=repeat)
    return min(times) / number * 1e6


def measure(number: int = 2000, repeat: int = 7, compile_too: bool = True) -> dict[str, float]:
    """µs per call of eager, fulmen.jit and (optionally) torch.compile, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = (torch.randn(8, 8), torch.randn(8, 8))
        candidates = {"eager": ten_ops, "fulmen.jit": fulmen.jit(ten_ops)}
        if compile_too:
            candidates["torch.compile"] = torch.compile(ten_ops)
        with torch.no_grad():
            expected = ten_ops(*args)
            for fn in candidates.values():
                torch.testing.assert_close(fn(*args), expected)
            return {name: per_call_us(fn, args, number, repeat)
                    for name, fn in candidates.items()}
    finally:
        torch.set_num_threads(threads)


def rows(compile_too: bool = True) -> list[dict]:
    """The summary rows `benchmarks/run_all.py` prints."""
    results = measure(compile_too=compile_too)
    return [{"benchmark": "per-call time, 10 elementwise ops, 8x8 (no grad)", "unit": "µs",
             "eager": results["eager"], "fulmen": results["fulmen.jit"],
             "torch.compile": results.get("torch.compile")}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    opts = parser.parse_args()
    results = measure(opts.number, opts.repeat, not opts.no_compile)

    eager = results["eager"]
    print(f"Per-call time, 10 elementwise ops on 8x8 float32 ({platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, 1 thread)\n")
    print("| callable | µs per call | over eager (µs) | ratio to eager |")
    print("| --- | ---: | ---: | ---: |")
    for name, us in results.items():
        print(f"| {name} | {us:.1f} | {us - eager:+.1f} | {us / eager:.2f} |")


if __name__ == "__main__":
    main()
