"""fulmen demo: jit a small model, print every stage of its trace, compare with eager.

Run with `make demo`.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import fulmen


class TinyBlock(torch.nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear with a residual connection."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        h = self.down(F.gelu(self.up(self.norm(x))))
        return (x + h).softmax(dim=-1)


def main() -> None:
    torch.manual_seed(0)
    model = TinyBlock().eval()
    jmodel = fulmen.jit(model)
    x = torch.randn(8, 64)

    with torch.no_grad():
        start = time.perf_counter()
        out = jmodel(x)
        first_call = time.perf_counter() - start
        expected = model(x)

    traces = fulmen.last_traces(jmodel)
    print(f"fulmen {fulmen.__version__}: {len(traces)} stages\n")
    print("=" * 30, "traced program (torch-level ops with their prim decompositions)")
    print(traces[0])
    print("=" * 30, "execution trace (what runs)")
    print(traces[-1])

    torch.testing.assert_close(out, expected)
    print(f"max |jit - eager| = {(out - expected).abs().max().item():.2e}")

    with torch.no_grad():
        jmodel(x)  # a cache hit: no tracing
    stats = fulmen.compile_stats(jmodel)
    print(f"calls={stats.calls} cache hits={stats.cache_hits} misses={stats.cache_misses}")
    print(f"first call (trace + compile) {first_call * 1e3:.1f} ms; stages:")
    for stage, seconds in stats.stage_seconds.items():
        print(f"  {stage:<28} {seconds * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
