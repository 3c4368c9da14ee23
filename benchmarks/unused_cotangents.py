"""A/B: the backward of a training step whose logits nobody backpropagates (issue 21).

HF models called with `labels=` return the loss and the logits; `loss.backward()` uses the
loss alone. Before `fulmen.transforms.unused_cotangents`, autograd handed the compiled backward a
zero-filled [B, T, V] cotangent for the logits, which the backward added into their gradient.
"old" is the same fulmen with that pass off (every cotangent materialized, as before), "new" is
the default. Both are compiled in one process and timed in alternation (process CPU time,
1 thread, median over rounds, the order swapped every round), so load on a shared machine
hits both alike.

Run: `python benchmarks/unused_cotangents.py [--models gpt2,llama] [--size tiny,small]`
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import fulmen  # noqa: E402
import fulmen.pipeline  # noqa: E402
from benchmarks.e2e import make_cases  # noqa: E402
from fulmen.executors.codegen import wait_for_kernels  # noqa: E402
from fulmen.tools.profile import execution_traces  # noqa: E402


def _jit_without_variants(model, step):
    """`fulmen.jit(model)`, compiled (by `step`) with unused cotangents materialized."""
    jitted = fulmen.jit(model)
    builder = fulmen.pipeline._variant_builder
    fulmen.pipeline._variant_builder = lambda *args: None
    try:
        step(jitted)
    finally:
        fulmen.pipeline._variant_builder = builder
    return jitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--number", type=int, default=10, help="steps per round")
    parser.add_argument("--repeat", type=int, default=40, help="rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for size in args.size.split(","):
        for case in make_cases(size, args.models.split(",")):
            model = case.model.train()

            def step(fn, case=case, model=model):
                model.zero_grad(set_to_none=True)
                case.call(fn).backward()

            old = _jit_without_variants(model, step)
            new = fulmen.jit(model)
            for fn in (old, new):  # warm until the codegen regions are hot and built
                for _ in range(8):
                    step(fn)
                wait_for_kernels(*execution_traces(fn))
                step(fn)
            assert not fulmen.compile_stats(old).last_backward_variants
            assert fulmen.compile_stats(new).last_backward_variants
            times = {(label, part): [] for label in ("old", "new") for part in ("fwd", "bwd")}
            pairs = (("old", old), ("new", new))
            for round_ in range(args.repeat):  # ABBA: whichever runs second in a round is slower
                for label, fn in pairs if round_ % 2 == 0 else pairs[::-1]:
                    forward = backward = 0.0
                    for _ in range(args.number):
                        model.zero_grad(set_to_none=True)
                        start = time.process_time()
                        loss = case.call(fn)
                        middle = time.process_time()
                        loss.backward()
                        forward += middle - start
                        backward += time.process_time() - middle
                    times[label, "fwd"].append(forward / args.number * 1e3)
                    times[label, "bwd"].append(backward / args.number * 1e3)
            for part in ("fwd", "bwd"):
                old_ms, new_ms = (statistics.median(times[k, part]) for k in ("old", "new"))
                print(f"{case.name:6s} {size:5s} {part}, 1 thread, CPU ms/step: old {old_ms:.3f}  "
                      f"new {new_ms:.3f}  new/old {new_ms / old_ms:.3f}", flush=True)

if __name__ == "__main__":
    main()
