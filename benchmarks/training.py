"""Training-step benchmark: forward+backward time and bytes saved for backward.

Models: a LayerNorm-Linear-GELU-Linear residual block (hidden 1024, 2048 tokens) and litgpt
pythia-14m (batch 4 x 128 tokens). For each: eager, fulmen with the torch executor and with
`executors=["codegen", "torch"]`, each with and without rematerialization, and torch.compile,
all measured in the same run. Step times are medians over rounds that take one step of every
callable in turn (after warm-up steps, which also compile the codegen kernels and fill the
kernel cache), so a change in the machine's load hits every callable alike.

Saved bytes are counted with `torch.autograd.graph.saved_tensors_hooks` (which also sees
tensors saved inside custom autograd Functions), each storage counted once, in two columns:
all storages, and activations only (the parameters' storages left out: eager and fulmen both
must keep the weights alive anyway, so saving a weight for backward is no extra memory).
Also: per-call time of a 10-op elementwise function whose input requires grad.

Run: `make bench` (or `python benchmarks/training.py [--quick] [--no-compile]`).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import timeit

import torch
import torch.nn.functional as F
from overhead import ten_ops, warm_up  # benchmarks/ is the script directory

import fulmen
from fulmen.executors.codegen import set_compile_policy

CODEGEN = ["codegen", "torch"]


class Block(torch.nn.Module):
    """x + Linear(GELU(Linear(LayerNorm(x))))."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def saved_bytes(step, exclude=()) -> int:
    """Bytes of distinct storages saved for backward while running `step()` (forward only),
    leaving out the storages of the tensors in `exclude` (e.g. the parameters)."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = step()
    del out
    return sum(size for ptr, size in seen.items() if ptr not in excluded)


def step_seconds(steps: dict, params, repeat: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds of one forward+backward step for each callable in `steps` (label ->
    `step()` returning the loss), measured in interleaved rounds."""

    def run(step):
        for p in params:
            p.grad = None
        step().backward()

    for step in steps.values():
        for _ in range(warmup):
            run(step)
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(repeat):
        for label, step in steps.items():
            start = time.perf_counter()
            run(step)
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(values) for label, values in times.items()}


def bench_model(name, make, make_input, loss_of, repeat, compile_too) -> list[tuple]:
    """Rows `(model, callable, seconds per step, saved bytes, saved bytes without params)`."""
    torch.manual_seed(0)
    model = make()
    x = make_input()
    candidates = {
        "eager": model,
        "fulmen (torch, no remat)": fulmen.jit(model, executors=["torch"], rematerialize=False),
        "fulmen (torch)": fulmen.jit(model, executors=["torch"]),
        "fulmen (codegen, no remat)": fulmen.jit(model, executors=CODEGEN, rematerialize=False),
        "fulmen (codegen)": fulmen.jit(model, executors=CODEGEN),
    }
    if compile_too:
        candidates["torch.compile"] = torch.compile(model)
    params = list(model.parameters())
    steps = {label: lambda fn=fn: loss_of(fn(x)) for label, fn in candidates.items()}
    previous = set_compile_policy("eager")  # warm-up builds every kernel: time kernels only
    try:
        seconds = step_seconds(steps, params, repeat)
    finally:
        set_compile_policy(previous.mode, previous.hot_calls)
    rows = []
    for label, fn in candidates.items():
        total = saved_bytes(lambda fn=fn: fn(x))
        activations = saved_bytes(lambda fn=fn: fn(x), exclude=params)
        rows.append((name, label, seconds[label], total, activations))
    return rows


def grad_call_us(repeat: int = 5) -> dict[str, float]:
    """µs per forward call of `ten_ops` with one 8x8 input requiring grad."""
    x, y = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8)
    results = {}
    for label, fn in (("eager", ten_ops), ("fulmen.jit", fulmen.jit(ten_ops))):
        warm_up(fn, (x, y))
        times = timeit.repeat(lambda fn=fn: fn(x, y), number=500, repeat=repeat)
        results[label] = min(times) / 500 * 1e6
    return results


def rows(quick: bool = False, compile_too: bool = True) -> list[dict]:
    """The summary rows `benchmarks/run_all.py` prints (fulmen = the default executors, codegen
    and torch, with remat)."""
    repeat = 3 if quick else 10
    hidden, tokens = (256, 512) if quick else (1024, 2048)
    measured = _models(hidden, tokens, repeat, compile_too)
    out = []
    for name in dict.fromkeys(r[0] for r in measured):
        by_label = {r[1]: r for r in measured if r[0] == name}
        compiled = by_label.get("torch.compile")
        out.append({"benchmark": f"{name}: forward+backward step", "unit": "ms",
                    "eager": by_label["eager"][2] * 1e3,
                    "fulmen": by_label["fulmen (codegen)"][2] * 1e3,
                    "torch.compile": compiled[2] * 1e3 if compiled else None})
        out.append({"benchmark": f"{name}: activations saved for backward", "unit": "MiB",
                    "eager": by_label["eager"][4] / 2**20,
                    "fulmen": by_label["fulmen (codegen)"][4] / 2**20,
                    "torch.compile": compiled[4] / 2**20 if compiled else None})
    calls = grad_call_us()
    out.append({"benchmark": "per-call time, 10 elementwise ops, 8x8, input requires grad",
                "unit": "µs", "eager": calls["eager"], "fulmen": calls["fulmen.jit"],
                "torch.compile": None})
    return out


def _models(hidden: int, tokens: int, repeat: int, compile_too: bool) -> list[tuple]:
    rows_ = bench_model(
        f"block h={hidden} n={tokens}", lambda: Block(hidden),
        lambda: torch.randn(tokens, hidden), lambda out: out.float().pow(2).mean(), repeat,
        compile_too)

    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config.from_name("pythia-14m")
    ids = torch.randint(0, config.padded_vocab_size, (4, 128))
    rows_ += bench_model(
        "pythia-14m 4x128", lambda: GPT(config), lambda: ids,
        lambda logits: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)),
        repeat, compile_too)
    return rows_


def _print_table(measured: list[tuple]) -> None:
    print("| model | callable | ms per step | vs eager | vs no remat | saved MiB, all storages "
          "| vs eager | saved MiB, activations only | vs eager |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    by_key = {(row[0], row[1]): row for row in measured}
    for name, label, seconds, total, activations in measured:
        _, _, e_s, e_total, e_act = by_key[name, "eager"]
        plain = by_key.get((name, label.replace(")", ", no remat)")))
        vs_plain = f"{seconds / plain[2]:.2f}" if plain and plain[1] != label else ""
        print(f"| {name} | {label} | {seconds * 1e3:.1f} | {seconds / e_s:.2f} | {vs_plain} | "
              f"{total / 2**20:.1f} | {total / e_total:.2f} | {activations / 2**20:.1f} | "
              f"{activations / e_act:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--repeat", type=int, help="timed rounds (default 10, 3 with --quick)")
    opts = parser.parse_args()
    repeat = opts.repeat or (3 if opts.quick else 10)
    hidden, tokens = (256, 512) if opts.quick else (1024, 2048)

    start = time.perf_counter()
    measured = _models(hidden, tokens, repeat, not opts.no_compile)
    print(f"Training step (forward+backward), {platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f} at the end, "
          f"{time.perf_counter() - start:.0f} s\n")
    print("Saved for backward: distinct storages; 'activations only' leaves out the parameters, "
          "which eager and fulmen both keep alive anyway.\n")
    _print_table(measured)

    results = grad_call_us()
    print("\nPer-call time, 10 elementwise ops on 8x8, one input requires grad (forward only)\n")
    print("| callable | µs per call | over eager (µs) |")
    print("| --- | ---: | ---: |")
    for label, us in results.items():
        print(f"| {label} | {us:.1f} | {us - results['eager']:+.1f} |")


if __name__ == "__main__":
    main()
