"""A jitted optimizer step and a jitted whole training step against eager (issue 21).

The model is 4 x [Linear(256, 256), GELU, LayerNorm(256)] + Linear(256, 10) (18 parameters) on a
(64, 256) batch. Rows, CPU time per call, medians of interleaved repetitions, in one process:

- `fulmen.jit(opt.step)` for AdamW (lr 1e-3, weight decay) and SGD (momentum 0.9), eager's
  `opt.step()` beside;
- a whole step `loss.backward(); opt.step(); opt.zero_grad()` inside one `fulmen.jit`
  function with AdamW, eager's beside.

Run: `PYTHONPATH=. python benchmarks/optim_step.py [threads]` (default 1 thread). Each row
prints eager ms, fulmen ms and fulmen / eager.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import fulmen

REPEATS, CALLS = 15, 10


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
                                  torch.nn.LayerNorm(256)) for _ in range(4)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 10))


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _data():
    torch.manual_seed(1)
    return torch.randn(64, 256), torch.randint(0, 10, (64,))


def _step_rows(kind: str) -> dict:
    """Eager `opt.step` and `fulmen.jit(opt.step)` on two copies of the model (grads set)."""
    x, y = _data()
    fns = {}
    for name in ("eager", "fulmen"):
        model = _model()
        opt = _optimizer(kind, model)
        F.cross_entropy(model(x), y).backward()
        fns[name] = fulmen.jit(opt.step) if name == "fulmen" else opt.step
    return fns


def _whole_rows() -> dict:
    """Eager training step and the same step inside one `fulmen.jit` function (AdamW)."""
    x, y = _data()
    fns = {}
    for name in ("eager", "fulmen"):
        step = _training_step(_model(), x, y)
        fns[name] = fulmen.jit(step) if name == "fulmen" else step
    return fns


def _training_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    opt = _optimizer("adamw", model)

    def step():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _time(fns: dict) -> dict[str, float]:
    for _ in range(5):  # warm up: compile, kernels hot
        for fn in fns.values():
            fn()
    fulmen.executors.codegen.wait_for_kernels(*fulmen.last_traces(fns["fulmen"]))
    for _ in range(3):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(REPEATS):
        for name, fn in fns.items():
            start = time.process_time()
            for _ in range(CALLS):
                fn()
            times[name].append((time.process_time() - start) / CALLS)
    stats = fulmen.compile_stats(fns["fulmen"])
    assert stats.eager_calls == 0, "the jitted rows ran eagerly"
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    fulmen.executors.codegen.set_compile_policy("eager")  # kernels compiled before timing
    print(f"torch {torch.__version__}, {threads} thread(s); CPU ms per call, medians")
    rows = {"AdamW opt.step": _step_rows("adamw"), "SGD(momentum) opt.step": _step_rows("sgd"),
            "whole step AdamW": _whole_rows()}
    for label, fns in rows.items():
        med = _time(fns)
        print(f"{label:24s} eager {med['eager'] * 1e3:6.3f}  fulmen {med['fulmen'] * 1e3:6.3f}"
              f"  ({med['fulmen'] / med['eager']:4.2f}x)")


if __name__ == "__main__":
    main()
