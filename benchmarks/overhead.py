"""Per-call overhead: a 10-op elementwise function on 8x8 tensors, and a small module,
8 x (Linear(16, 16) + ReLU) on a (4, 16) input (issue 21: both should beat eager's many
dispatches), without grad.

Measures eager, fulmen.jit and torch.compile in one run, in interleaved rounds (each round times
every callable in turn; medians over rounds), and prints a markdown table with microseconds per
call in thread CPU time (what other load on a shared machine disturbs least) and the ratios to
eager in CPU and wall time. Run: `make bench`.

`--regions` instead measures what a codegen region call costs against the torch ops it
replaces: chains of k elementwise ops on n elements, jitted with the torch executor alone and
with codegen (`FULMEN_FUSE_TINY=1`, so every region is fused), in thread CPU time per call (a
shared machine's other load barely moves it). This chose `fulmen.transforms.region_size.TINY_REGION`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
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


CHAIN = (lambda a, y: a + y, lambda a, y: a * y, lambda a, y: a - y,
         lambda a, y: torch.sin(a), lambda a, y: a * 2.0, lambda a, y: torch.exp(a),
         lambda a, y: a / (y + 3.0), lambda a, y: torch.tanh(a), lambda a, y: torch.relu(a),
         lambda a, y: a + 1.0)


def chain(k: int):
    """The first k ops of `CHAIN` (those of `ten_ops`, one statement each) as a function."""

    def fn(x, y):
        for op in CHAIN[:k]:
            x = op(x, y)
        return x

    return fn


def thread_us(fn, args, number: int, repeat: int = 7) -> float:
    """Best thread CPU time per call in µs, after warming up."""
    warm_up(fn, args)
    best = float("inf")
    for _ in range(repeat):
        start = time.thread_time()
        for _ in range(number):
            fn(*args)
        best = min(best, time.thread_time() - start)
    return best / number * 1e6


def region_rows(ops: list[int], sizes: list[int]) -> None:
    """Print the region-call table (`--regions`, see the module docstring)."""
    os.environ["FULMEN_FUSE_TINY"] = "1"
    torch.set_num_threads(1)
    print("| k ops | elements | torch executor µs | codegen µs | codegen - torch |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    with torch.no_grad():
        for n in sizes:
            for k in ops:
                args = (torch.randn(n), torch.randn(n))
                number = max(100, min(3000, 2_000_000 // (n * k)))
                on_torch = thread_us(fulmen.jit(chain(k), executors=["torch"]), args, number)
                fused = thread_us(fulmen.jit(chain(k), executors=["codegen", "torch"]), args,
                                  number)
                print(f"| {k} | {n} | {on_torch:.2f} | {fused:.2f} | {fused - on_torch:+.2f} |",
                      flush=True)


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
    """Best wall time per call in µs of one callable alone, after warming up (`breaks.py`)."""
    warm_up(fn, args)
    times = timeit.repeat(lambda: fn(*args), number=number, repeat=repeat)
    return min(times) / number * 1e6


def interleaved_us(candidates: dict, args, number: int, repeat: int) -> dict[str, tuple]:
    """`{name: (wall µs, thread CPU µs)}` per call: `repeat` rounds, each timing `number` calls
    of every candidate in turn, and the median over rounds of each (so load that comes and
    goes on a shared machine hits every candidate alike; thread CPU time also leaves out the
    time other processes held the core)."""
    for fn in candidates.values():
        warm_up(fn, args)
    wall: dict[str, list] = {name: [] for name in candidates}
    cpu: dict[str, list] = {name: [] for name in candidates}
    for _ in range(repeat):
        for name, fn in candidates.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(number):
                fn(*args)
            wall[name].append((time.perf_counter() - start) / number * 1e6)
            cpu[name].append((time.thread_time() - start_cpu) / number * 1e6)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name]))
            for name in candidates}


def linear_relu() -> torch.nn.Module:
    """The small module: 8 x (Linear(16, 16) + ReLU)."""
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def measure(number: int = 1000, repeat: int = 9, compile_too: bool = True,
            module: bool = False, clock: str = "cpu") -> dict[str, float]:
    """µs per call of eager, fulmen.jit and (optionally) torch.compile, on one thread, of
    `ten_ops` on 8x8 tensors or (`module=True`) of `linear_relu()` on a (4, 16) input: medians
    of interleaved rounds (`interleaved_us`) in thread CPU time (`clock="cpu"`) or wall time
    (`"wall"`; `"both"`: `{name: (wall, cpu)}`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        fn = linear_relu() if module else ten_ops
        args = (torch.randn(4, 16),) if module else (torch.randn(8, 8), torch.randn(8, 8))
        candidates = {"eager": fn, "fulmen.jit": fulmen.jit(fn)}
        if compile_too:
            candidates["torch.compile"] = torch.compile(fn)
        with torch.no_grad():
            expected = fn(*args)
            for fn in candidates.values():
                torch.testing.assert_close(fn(*args), expected)
            results = interleaved_us(candidates, args, number, repeat)
    finally:
        torch.set_num_threads(threads)
    if clock == "both":
        return results
    return {name: times[clock == "cpu"] for name, times in results.items()}


def rows(compile_too: bool = True) -> list[dict]:
    """The summary rows `benchmarks/run_all.py` prints."""
    rows = []
    for module, label in ((False, "10 elementwise ops, 8x8"),
                          (True, "8 x (Linear(16, 16) + ReLU), 4x16")):
        results = measure(compile_too=compile_too, module=module)
        rows.append({"benchmark": f"per-call time, {label} (no grad)", "unit": "µs",
                     "eager": results["eager"], "fulmen": results["fulmen.jit"],
                     "torch.compile": results.get("torch.compile")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=1000, help="calls per timed round")
    parser.add_argument("--repeat", type=int, default=9, help="interleaved rounds (median)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--regions", action="store_true",
                        help="region call vs torch ops table (see the module docstring)")
    parser.add_argument("--ops", default="1,2,3,4,6,10", help="--regions: chain lengths")
    parser.add_argument("--sizes", default="64,1024,16384,65536", help="--regions: elements")
    opts = parser.parse_args()
    if opts.regions:
        region_rows([int(k) for k in opts.ops.split(",")],
                    [int(n) for n in opts.sizes.split(",")])
        return
    machine = platform.processor() or platform.machine()
    for module, label in ((False, "10 elementwise ops on 8x8 float32"),
                          (True, "8 x (Linear(16, 16) + ReLU) on a (4, 16) input")):
        results = measure(opts.number, opts.repeat, not opts.no_compile, module=module,
                          clock="both")
        eager_wall, eager_cpu = results["eager"]
        print(f"Per-call time, {label} ({machine}, torch {torch.__version__}, 1 thread, "
              f"no grad; medians of {opts.repeat} interleaved rounds, load average "
              f"{os.getloadavg()[0]:.1f})\n")
        print("| callable | µs per call (CPU) | over eager (µs) | ratio to eager (CPU) "
              "| ratio to eager (wall) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, (wall, cpu) in results.items():
            print(f"| {name} | {cpu:.1f} | {cpu - eager_cpu:+.1f} | {cpu / eager_cpu:.2f} "
                  f"| {wall / eager_wall:.2f} |")
        print()


if __name__ == "__main__":
    main()
