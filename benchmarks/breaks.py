"""Graph-break overhead: a program cut by k value-dependent `if`s vs its segments alone.

For k = 0..3 the 10-op elementwise function of `overhead.py` is cut into k+1 chunks by
`if h.sum() > -1e30:` (always true). Measured in one run, µs per call on one thread, no grad:
eager, fulmen.jit of the whole function (a trace tree of k+1 segments), and "segments alone": each
chunk jitted on its own and called one after another from Python (no guards). The difference
is what a break costs (the guard, its `bool()` and the tree walk). Run:
`.venv/bin/python -m benchmarks.breaks`.
"""

from __future__ import annotations

import argparse
import platform

import torch

import fulmen
from benchmarks.overhead import per_call_us

_CHUNKS = (
    lambda x, y, h: (x + y) * x,
    lambda x, y, h: torch.sin(h - y) * 2.0,
    lambda x, y, h: torch.exp(h) / (y + 3.0),
    lambda x, y, h: torch.tanh(h) + x,
)


def program(breaks: int):
    """The 10-op function with `breaks` value-dependent `if`s between its chunks."""
    chunks = _split(breaks)

    def fn(x, y):
        h = None
        for index, chunk in enumerate(chunks):
            if index:
                if h.sum() > -1e30:  # a graph break (its question: a sum and a compare)
                    pass
            h = chunk(x, y, h)
        return h
    return fn


def _split(breaks: int):
    """`breaks + 1` functions that together compute the four chunks in order."""
    bounds = [round(i * len(_CHUNKS) / (breaks + 1)) for i in range(breaks + 2)]
    groups = [list(range(bounds[i], bounds[i + 1])) for i in range(breaks + 1)]

    def make(indices):
        def piece(x, y, h):
            for index in indices:
                h = _CHUNKS[index](x, y, h)
            return h
        return piece
    return [make(indices) for indices in groups]


def segments_alone(breaks: int):
    """The same chunks, each jitted on its own, called in sequence (no guards)."""
    pieces = [fulmen.jit(piece) for piece in _split(breaks)]

    def fn(x, y):
        h = torch.empty(0)
        for index, piece in enumerate(pieces):
            h = piece(x, y, h) if index else piece(x, y, torch.zeros(()))
        return h
    return fn


def measure(number: int = 1000, repeat: int = 7) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        args = (torch.randn(8, 8), torch.randn(8, 8))
        with torch.no_grad():
            for breaks in range(4):
                eager = program(breaks)
                jitted = fulmen.jit(eager)
                alone = segments_alone(breaks)
                torch.testing.assert_close(jitted(*args), eager(*args))
                torch.testing.assert_close(alone(*args), eager(*args))
                times = {name: per_call_us(fn, args, number, repeat)
                         for name, fn in (("eager", eager), ("fulmen", jitted),
                                          ("segments alone", alone))}
                rows.append({"breaks": breaks, **times})
    finally:
        torch.set_num_threads(threads)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=1000)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {platform.machine()}, 1 thread, µs per call")
    print("| breaks | eager | fulmen | segments alone | fulmen - segments | per break |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in measure(args.number):
        extra = row["fulmen"] - row["segments alone"]
        per = extra / row["breaks"] if row["breaks"] else float("nan")
        print(f"| {row['breaks']} | {row['eager']:.1f} | {row['fulmen']:.1f} | "
              f"{row['segments alone']:.1f} | {extra:+.1f} | {per:+.1f} |")


if __name__ == "__main__":
    main()
