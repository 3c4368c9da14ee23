"""A jitted optimizer step under an LR scheduler (NOTE [floats read at run time]): compiles,
eager fallbacks and CPU time of the step calls, eager beside, in one process.

`fulmen.jit(opt.step)` for AdamW on 4 Linear(256, 256) layers, 50 steps under
CosineAnnealingLR and under a constant learning rate (Adam's step count, read with `.item()`,
changes at every step either way). Before floats were read at run time each new learning rate
or step count compiled again, and past `cache_size_limit` the calls ran eagerly.

Run: `PYTHONPATH=. python benchmarks/optimizer_schedule.py` (times are CPU ms of steps 5-49).
"""

from __future__ import annotations

import time
import warnings

import torch

import fulmen

STEPS, WARMUP = 50, 5


def _run(schedule: str, jit: bool) -> tuple[float, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS) if schedule == "cosine"
             else torch.optim.lr_scheduler.ConstantLR(opt, 1.0, total_iters=0))
    step = fulmen.jit(opt.step) if jit else opt.step
    x = torch.randn(32, 256)
    total = 0.0
    for i in range(STEPS):
        model(x).square().mean().backward()
        start = time.process_time()
        step()
        if i >= WARMUP:
            total += time.process_time() - start
        opt.zero_grad()
        sched.step()
    return total, fulmen.compile_stats(step) if jit else None


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    for schedule in ("cosine", "constant"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (cache_size_limit warnings, before)
            eager, _ = _run(schedule, False)
            jitted, stats = _run(schedule, True)
        print(f"AdamW {schedule:8s} eager {eager * 1e3:6.1f} ms  fulmen {jitted * 1e3:6.1f} ms"
              f" ({jitted / eager:4.2f}x)  compiles {stats.cache_misses}  eager calls"
              f" {stats.eager_calls}")


if __name__ == "__main__":
    main()
