"""Fusion benchmark (CPU, float32): fulmen's codegen executor vs eager and torch.compile.

    .venv/bin/python benchmarks/fusion.py [--n 4096] [--repeats 7] [--no-compile-time]

Kernels (issue 5): gelu(x*y+b), LayerNorm forward, LayerNorm forward+backward, RMSNorm,
softmax, an Adam update, (x+b)*s+r, on n x n inputs (b, weights: n). For each: the median time
per call of eager, torch.compile and fulmen codegen, the speedups, and codegen's achieved
bandwidth (the minimal bytes the computation must move / time) as a fraction of
`torch.add(a, b, out=c)`'s bandwidth measured in the same run: each kernel runs 5 alternating
rounds of add, eager, torch.compile and codegen (median of `--repeats` calls each), and the
fraction is the median over rounds of the ratio within a round. Then the compile time of
litgpt pythia-14m forward+backward (first call, in a fresh process): fulmen codegen with an
empty kernel cache (cold) and again with that cache (warm), and torch.compile with an empty
inductor cache. Kernels compile into a fresh temporary FULMEN_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

# --- the kernels: (function, make inputs, full-size tensors moved, backward?) ----------------


def gelu_fma(x, y, b):
    return F.gelu(x * y + b)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)


def softmax(x):
    return F.softmax(x, -1)


def adam(p, g, m, v):
    m = m * 0.9 + g * 0.1
    v = v * 0.999 + g * g * 0.001
    update = (m / (1 - 0.9**10)) / ((v / (1 - 0.999**10)).sqrt() + 1e-8)
    return p - 1e-3 * update, m, v


def bias_scale_residual(x, b, s, r):
    return (x + b) * s + r


def _kernels(n: int):
    def full():
        return torch.randn(n, n)

    def vec():
        return torch.randn(n)

    return [
        ("gelu(x*y+b)", gelu_fma, lambda: (full(), full(), vec()), 3, False),
        ("LayerNorm fwd", layer_norm, lambda: (full(), vec(), vec()), 2, False),
        ("LayerNorm fwd+bwd", layer_norm, lambda: (full(), vec(), vec()), 5, True),
        ("RMSNorm", rms_norm, lambda: (full(), vec()), 2, False),
        ("softmax", softmax, lambda: (full(),), 2, False),
        ("Adam update", adam, lambda: (full(), full(), full(), full().abs()), 7, False),
        ("(x+b)*s+r", bias_scale_residual, lambda: (full(), vec(), full(), full()), 4, False),
    ]


def _median_time(call, repeats: int, warm_up: bool = True) -> float:
    """Median seconds of `repeats` calls, after (with `warm_up`) at least 3 calls and 0.5 s (at
    most 20 calls): on a VM, memory the guest never touched is backed by the host at first
    touch, which costs milliseconds per fresh 2 MiB and would otherwise be timed as the
    kernel's."""
    start, warm = time.perf_counter(), 0
    while warm_up and warm < 20 and (warm < 3 or time.perf_counter() - start < 0.5):
        call()
        warm += 1
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _runner(fn, args, backward: bool):
    if not backward:
        return lambda: fn(*args)
    leaves = [a.detach().requires_grad_() for a in args]
    grad = torch.randn(args[0].shape)

    def step():
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves).backward(grad)

    return step


def measure_kernels(n: int, repeats: int, rounds: int = 5):
    """Yield `(name, tensors moved, {"eager"|"compile"|"codegen"|"add": seconds}, add ratio)` per
    kernel. `rounds` alternating rounds each time `torch.add(a, b, out=c)`, eager, torch.compile
    and codegen (median of `repeats` calls each; the VM's speed drifts over seconds); times are
    medians over rounds and `add ratio` is the median over rounds of add time / codegen time."""
    import fulmen
    from fulmen.executors.codegen import set_compile_policy

    set_compile_policy("eager")  # time the kernels, not the torch fallback of a cold region
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    for name, fn, make, tensors, backward in _kernels(n):
        args = make()
        jfn = fulmen.jit(fn, executors=["codegen", "torch"])
        cfn = torch.compile(fn)
        if not backward:
            torch.testing.assert_close(jfn(*args), fn(*args), rtol=1e-4, atol=1e-4)
        calls = {"add": lambda: torch.add(a, b, out=c),
                 **{label: _runner(f, args, backward)
                    for label, f in (("eager", fn), ("compile", cfn), ("codegen", jfn))}}
        samples = {label: [] for label in calls}
        for r in range(rounds):
            for label, call in calls.items():
                samples[label].append(_median_time(call, repeats, warm_up=r == 0))
        ratio = statistics.median(x / y for x, y in zip(samples["add"], samples["codegen"]))
        yield name, tensors, {k: statistics.median(v) for k, v in samples.items()}, ratio


def rows(quick: bool = False, compile_too: bool = True) -> list[dict]:
    """The summary rows `benchmarks/run_all.py` prints (codegen executor)."""
    n = 1024 if quick else 4096
    os.environ.setdefault("FULMEN_CACHE_DIR", tempfile.mkdtemp(prefix="fulmen-bench-"))
    out = [{"benchmark": f"fused kernel: {name}, float32 {n}x{n} (codegen)", "unit": "ms",
            "eager": times["eager"] * 1e3, "fulmen": times["codegen"] * 1e3,
            "torch.compile": times["compile"] * 1e3}
           for name, _, times, _ in measure_kernels(n, 3 if quick else 5, 1 if quick else 3)]
    if compile_too and not quick:
        kernels = tempfile.mkdtemp(prefix="fulmen-bench-cache-")
        inductor = tempfile.mkdtemp(prefix="inductor-bench-cache-")
        out.append({"benchmark": "pythia-14m fwd+bwd first call, empty caches (codegen)",
                    "unit": "s", "eager": None,
                    "fulmen": _child("codegen", {"FULMEN_CACHE_DIR": kernels,
                                                 "FULMEN_CODEGEN_COMPILE": "eager"}),
                    "torch.compile": _child("compile", {"TORCHINDUCTOR_CACHE_DIR": inductor,
                                                        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"})})
    return out


def bench_kernels(n: int, repeats: int) -> list[str]:
    rows = ["| kernel | eager ms | torch.compile ms | codegen ms | vs eager | vs compile "
            "| add(out=) ms | bandwidth vs add |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    speedups_eager, speedups_compile = [], []
    for name, tensors, times, add_ratio in measure_kernels(n, repeats):
        # codegen bytes/s over add's (3 tensors), per round: median of add time / codegen time
        fraction = add_ratio * tensors / 3
        vs_eager = times["eager"] / times["codegen"]
        vs_compile = times["compile"] / times["codegen"]
        speedups_eager.append(vs_eager)
        speedups_compile.append(vs_compile)
        rows.append(f"| {name} | {times['eager'] * 1e3:.2f} | {times['compile'] * 1e3:.2f} | "
                    f"{times['codegen'] * 1e3:.2f} | {vs_eager:.2f}x | {vs_compile:.2f}x | "
                    f"{times['add'] * 1e3:.2f} | {fraction:.0%} |")

    def geomean(values):
        return math.exp(sum(math.log(v) for v in values) / len(values))

    rows.append(f"| geometric mean | | | | {geomean(speedups_eager):.2f}x | "
                f"{geomean(speedups_compile):.2f}x | |")
    return rows


# --- compile time of pythia-14m forward+backward (each measurement in a fresh process) --------

_CHILD = r"""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch, torch.nn.functional as F
from litgpt.config import Config
from litgpt.model import GPT
mode = sys.argv[1]
torch.manual_seed(0)
model = GPT(Config.from_name("pythia-14m", vocab_size=512, padded_vocab_size=512))
ids = torch.randint(0, 512, (4, 64))
if mode == "codegen":
    import fulmen
    run = fulmen.jit(model, executors=["codegen", "torch"])
else:
    run = torch.compile(model)
start = time.perf_counter()
logits = run(ids)
F.cross_entropy(logits.reshape(-1, 512), ids.reshape(-1)).backward()
print(time.perf_counter() - start)
"""


def _child(mode: str, env: dict) -> float:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def bench_compile_time() -> list[str]:
    kernels = tempfile.mkdtemp(prefix="fulmen-bench-cache-")
    inductor = tempfile.mkdtemp(prefix="inductor-bench-cache-")
    lazy = _child("codegen", {"FULMEN_CACHE_DIR": tempfile.mkdtemp(prefix="fulmen-bench-lazy-"),
                              "FULMEN_CODEGEN_COMPILE": "lazy"})
    eager = {"FULMEN_CACHE_DIR": kernels, "FULMEN_CODEGEN_COMPILE": "eager"}
    cold = _child("codegen", eager)
    warm = _child("codegen", eager)
    compiled = _child("compile", {"TORCHINDUCTOR_CACHE_DIR": inductor,
                                  "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"})
    return ["", "pythia-14m forward+backward, first call (batch 4 x 64):", "",
            "| variant | seconds |", "| --- | --- |",
            f"| fulmen codegen, empty kernel cache, every kernel compiled | {cold:.2f} |",
            f"| fulmen codegen, empty kernel cache, lazy (default: torch until hot) | {lazy:.2f} |",
            f"| fulmen codegen, warm disk cache | {warm:.2f} |",
            f"| torch.compile, empty inductor cache | {compiled:.2f} |",
            f"| cold codegen / torch.compile | {cold / compiled:.2f} |"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-compile-time", action="store_true")
    opts = parser.parse_args()
    os.environ["FULMEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="fulmen-bench-")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"float32 {opts.n}x{opts.n}, 5 alternating rounds of {opts.repeats} calls per method, "
          f"load average {os.getloadavg()[0]:.2f}\n")
    print("\n".join(bench_kernels(opts.n, opts.repeats)))
    if not opts.no_compile_time:
        print("\n".join(bench_compile_time()))


if __name__ == "__main__":
    main()
