"""Dynamic shapes (issue 16): a sweep of sequence lengths x batch sizes, and KV-cache decoding,
eager vs fulmen vs torch.compile in the same run.

Sweep: HF Llama, GPT-2 and Qwen2 (tiny configs of the installed transformers, random weights)
called with 12 sequence lengths x 3 batch sizes, forward under `no_grad` and a training step
(forward with `labels=`, backward). For each callable the first pass over the 36 shapes (which
includes every compilation) and a second, steady-state pass are timed; compilations are
counted (fulmen: cache misses; torch.compile: frames compiled, from `torch._dynamo.utils`).

Decode: `generate(max_new_tokens=N, do_sample=False)` with the default DynamicCache and with the
static cache (`cache_implementation="static"`); tokens are
compared with eager; the compilations of the jitted forward are counted, and the best of
`REPEATS` more generates (everything compiled; the kinds interleaved, so that a shared host's
load weighs on each alike) gives the per-token time.

Breakdown (`--breakdown`): where fulmen's first pass goes, in CPU milliseconds of this
process: each call that compiled (with its stages' wall seconds from `fulmen.compile_stats`, the
backward's stages included), the collector's full collections, and the other calls beside
eager's time for the same calls and fulmen's for them again in a second pass (nothing new to
compile): the difference is what a new shape costs a compiled entry (binding a symbolic
region's sizes, a kernel call plan per region and shape); the plans made in the whole first
pass, and their CPU milliseconds (binding included), are counted apart (`_PlanClock`).

Run: `python benchmarks/dynamic.py [--models llama,gpt2,qwen2,gemma2] [--tokens 64] [--no-compile]
[--skip-sweep] [--skip-decode] [--caches dynamic,static] [--breakdown]`
(with `PYTHONPATH=.` from a checkout: a script's own folder comes first on `sys.path`).
`FULMEN_DYNAMIC=defer` in the environment runs each first call eagerly, compiling from the
second (NOTE [a deferred first call] in `fulmen/tracer/shape_policy.py`): one compilation per
sweep instead of two.
Times are seconds (sweep) and ms per token (decode); ratios are fulmen or torch.compile / eager.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

import fulmen

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LENGTHS = (5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38)
BATCHES = (1, 2, 4)
VOCAB = 96
REPEATS = 5


def _model(name: str) -> torch.nn.Module:
    import transformers as T

    common = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                  max_position_embeddings=256)
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common))
    if name == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**common))
    if name == "gemma2":  # sliding-window layers: their cache layers count tokens in an int
        return T.Gemma2ForCausalLM(T.Gemma2Config(**common, head_dim=8, sliding_window=16))
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB,
                                              n_positions=256))
    raise ValueError(f"unknown model {name!r}")


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the C++ compiler): on a shared
    machine they measure the work where wall time measures the neighbours too. The process's
    own from `time.process_time` (os.times counts in 10 ms ticks: 0.16 ms per token of a
    64-token generate)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def _sweep(call, train: bool) -> tuple[float, float]:
    """(wall, CPU) seconds for one pass over every (batch, length) shape."""
    start, cpu = time.perf_counter(), _cpu()
    for batch in BATCHES:
        for length in LENGTHS:
            ids = torch.randint(0, VOCAB, (batch, length))
            if train:
                call(ids, labels=ids).loss.backward()
            else:
                with torch.no_grad():
                    call(ids)
    return time.perf_counter() - start, _cpu() - cpu


def _compiles(callable_, kind: str) -> int:
    if kind == "fulmen":
        return fulmen.cache_misses(callable_)
    if kind == "torch.compile":
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    return 0


def sweep(name: str, use_compile: bool) -> None:
    for train in (False, True):
        torch.manual_seed(0)
        model = _model(name).train(train)
        kinds = {"eager": model, "fulmen": fulmen.jit(model)}
        if use_compile:
            _reset_torch_compile()
            kinds["torch.compile"] = torch.compile(model)
        row = {}
        for kind, call in kinds.items():
            first = _sweep(call, train)
            steady = _sweep(call, train)
            row[kind] = (first, steady, _compiles(call, kind))
        (eager_first, eager_first_cpu), (eager_steady, eager_steady_cpu), _ = row["eager"]
        label = f"{name} {'train' if train else 'forward'}"
        for kind, ((first, first_cpu), (steady, steady_cpu), compiles) in row.items():
            print(f"{label:16s} {kind:14s} first pass {first:7.2f} s ({first / eager_first:5.2f}x,"
                  f" cpu {first_cpu:6.2f} s {first_cpu / eager_first_cpu:5.2f}x)  steady"
                  f" {steady:6.2f} s ({steady / eager_steady:5.2f}x, cpu"
                  f" {steady_cpu / eager_steady_cpu:5.2f}x)  compiles {compiles}")


class _PlanClock:
    """The count and CPU seconds of the CPU runtime's call plans made while it is entered: it
    wraps `FusedRegion`'s plan makers and the binding of a symbolic region's sizes."""

    def __init__(self) -> None:
        from fulmen.executors.codegen.cpu.runtime import FusedRegion
        from fulmen.executors.codegen.region import RegionCallable

        self.seconds, self.plans = 0.0, 0
        self._patched = [(FusedRegion, "_plan"), (FusedRegion, "_plan_rows"),
                         (RegionCallable, "bind")]
        self._saved = [cls.__dict__[attr] for cls, attr in self._patched]

    def __enter__(self) -> _PlanClock:
        for (cls, attr), method in zip(self._patched, self._saved):
            setattr(cls, attr, self._timed(method, attr != "bind"))
        return self

    def __exit__(self, *exc) -> None:
        for (cls, attr), method in zip(self._patched, self._saved):
            setattr(cls, attr, method)

    def _timed(self, method, counts: bool):
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - start
                self.plans += counts

        return timed


def breakdown(name: str) -> None:
    """Print where fulmen's first pass over the sweep goes (module docstring)."""
    collections: list[float] = []

    def timed(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                timed.start = time.process_time()
            else:
                collections.append(time.process_time() - timed.start)

    for train in (False, True):
        torch.manual_seed(0)
        model = _model(name).train(train)
        jitted = fulmen.jit(model)
        eager_cpu, other, compiles, clock = 0.0, 0.0, [], _PlanClock()
        collections.clear()
        gc.callbacks.append(timed)
        try:
            for batch in BATCHES:
                for length in LENGTHS:
                    ids = torch.randint(0, VOCAB, (batch, length))
                    for kind, call in (("eager", model), ("fulmen", jitted)):
                        misses, full = fulmen.cache_misses(jitted), len(collections)
                        with clock:
                            cpu = _call_cpu(call, ids, train)
                        if kind == "eager":
                            eager_cpu += cpu
                        elif fulmen.cache_misses(jitted) != misses:
                            stages = fulmen.compile_stats(jitted).stage_seconds
                            compiles.append((batch, length, cpu, dict(stages)))
                        else:
                            other += cpu - sum(collections[full:])
        finally:
            gc.callbacks.remove(timed)
        compiled = {(batch, length) for batch, length, _, _ in compiles}
        again = sum(_call_cpu(jitted, torch.randint(0, VOCAB, (batch, length)), train)
                    for batch in BATCHES for length in LENGTHS if (batch, length) not in compiled)
        label = f"{name} {'train' if train else 'forward'}"
        total = other + sum(c[2] for c in compiles) + sum(collections)
        print(f"{label}: fulmen first pass {total * 1e3:.0f} ms cpu, eager {eager_cpu * 1e3:.0f}"
              f" ms ({total / eager_cpu:.1f}x)")
        for batch, length, cpu, stages in compiles:
            parts = ", ".join(f"{stage} {seconds * 1e3:.0f}" for stage, seconds in stages.items())
            print(f"  compile at ({batch}, {length}): {cpu * 1e3:.0f} ms cpu ({parts})")
        print(f"  full collections: {len(collections)}, {sum(collections) * 1e3:.0f} ms;"
              f" the other {36 - len(compiles)} calls: {other * 1e3:.0f} ms, again in a second"
              f" pass {again * 1e3:.0f} ms")
        print(f"  call plans made in the first pass: {clock.plans},"
              f" {clock.seconds * 1e3:.0f} ms cpu (binding sizes included)")


def _call_cpu(call, ids: torch.Tensor, train: bool) -> float:
    """CPU seconds of this process for one call of the sweep on token ids `ids`."""
    start = time.process_time()
    if train:
        call(ids, labels=ids).loss.backward()
    else:
        with torch.no_grad():
            call(ids)
    return time.process_time() - start


def _reset_torch_compile() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # the frame counts are per callable, not summed over the run


def decode(name: str, tokens: int, use_compile: bool, cache: str) -> None:
    torch.manual_seed(0)
    model = _model(name).eval()
    ids = torch.randint(0, VOCAB, (1, 6))
    original = model.forward
    kinds = {"eager": model, "fulmen": fulmen.jit(model)}
    if use_compile:
        _reset_torch_compile()
        kinds["torch.compile"] = torch.compile(original)
    options = dict(max_new_tokens=tokens, do_sample=False)
    if cache == "static":
        options["cache_implementation"] = "static"
    outs, firsts = {}, {}
    best = {kind: (float("inf"), float("inf")) for kind in kinds}
    for round_ in range(1 + REPEATS):  # the first generate of each, then interleaved repeats
        for kind, call in kinds.items():
            start, cpu = time.perf_counter(), _cpu()
            out = _generate(model, original, kind, call, ids, options)
            wall, cpu = time.perf_counter() - start, _cpu() - cpu
            if round_ == 0:
                outs[kind], firsts[kind] = out, wall
            else:
                best[kind] = (min(best[kind][0], wall), min(best[kind][1], cpu))
    eager_wall, eager_cpu = best["eager"]
    for kind, call in kinds.items():
        wall, cpu = (t / tokens * 1e3 for t in best[kind])
        same = torch.equal(outs[kind], outs["eager"])
        print(f"{name:6s} {cache:7s} decode {kind:14s} first generate {firsts[kind]:6.2f} s  per"
              f" token {wall:6.2f} ms ({best[kind][0] / eager_wall:4.2f}x, cpu {cpu:6.2f} ms"
              f" {best[kind][1] / eager_cpu:4.2f}x)  tokens equal {same}"
              f"  compiles {_compiles(call, kind)}")


def _generate(model, original, kind: str, call, ids, options):
    """One `generate` of `model` with the forward of `kind` (eager, fulmen, torch.compile)."""
    if kind == "torch.compile":  # generate() calls the module, which calls this forward
        model.forward = call
    try:
        return (call.generate if kind == "fulmen" else model.generate)(ids, **options)
    finally:
        model.forward = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,gpt2,qwen2")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--caches", default="dynamic,static",
                        help="KV caches to decode with: dynamic (DynamicCache), static")
    parser.add_argument("--breakdown", action="store_true",
                        help="where fulmen's first pass goes (module docstring), then stop")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    for name in args.models.split(","):
        if args.breakdown:
            breakdown(name)
            continue
        if not args.skip_sweep:
            sweep(name, not args.no_compile)
        if not args.skip_decode:
            for cache in args.caches.split(","):
                decode(name, args.tokens, not args.no_compile, cache)


if __name__ == "__main__":
    main()
