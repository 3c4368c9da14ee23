"""GPT-2 tiny training step with attention dropout decomposed (NOTE [attention dropout]) versus
run opaquely under torch.autograd (as before issue 21's change), and eager, in one process:
rounds alternate the three callables, so load on a shared machine hits them alike. Prints ms
per step (wall and process CPU time, medians) and the CPU-time ratio to eager.

Run: `python benchmarks/attention_dropout.py [--rounds 30] [--number 5]`
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from e2e import make_cases

import fulmen
import fulmen.ops.torch.attention as attention
from fulmen.executors.codegen import wait_for_kernels
from fulmen.tools.profile import execution_traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--number", type=int, default=5, help="steps per timed sample")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    case = make_cases("tiny", ["gpt2"])[0]
    model = case.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step(fn):
        optimizer.zero_grad(set_to_none=True)
        case.call(fn).backward()
        optimizer.step()

    decomposed, opaque = fulmen.jit(model), fulmen.jit(model)
    refuse = attention._math_dropout
    attention._math_dropout = lambda *args: False  # traced while refused: the op runs opaquely
    try:
        for _ in range(7):
            step(opaque)
    finally:
        attention._math_dropout = refuse
    for _ in range(7):
        step(decomposed)
    wait_for_kernels(*execution_traces(decomposed), *execution_traces(opaque))
    assert any("autograd_forward" in str(t) for t in execution_traces(opaque))
    assert not any("autograd_forward" in str(t) for t in execution_traces(decomposed))
    fns = {"eager": model, "decomposed": decomposed, "opaque": opaque}
    wall: dict[str, list[float]] = {label: [] for label in fns}
    cpu: dict[str, list[float]] = {label: [] for label in fns}
    for _ in range(opts.rounds):
        for label, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(opts.number):
                step(fn)
            wall[label].append((time.perf_counter() - start) / opts.number * 1e3)
            cpu[label].append((time.process_time() - start_cpu) / opts.number * 1e3)
    for label in fns:
        ratio = statistics.median(a / b for a, b in zip(cpu[label], cpu["eager"]))
        print(f"{label}: {statistics.median(wall[label]):.2f} ms wall, "
              f"{statistics.median(cpu[label]):.2f} ms CPU, CPU / eager {ratio:.3f}")


if __name__ == "__main__":
    main()
