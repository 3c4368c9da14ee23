"""`make bench`: every benchmark in one run, printed as one markdown table.

Each row: the measurement for eager PyTorch, fulmen and torch.compile, all taken in this run,
and fulmen's ratio to each (below 1 is better for time and memory). The per-benchmark scripts
(`overhead.py`, `training.py`, `fusion.py`) print more detail when run on their own.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time

import torch

BENCHMARKS = ("overhead", "training", "fusion")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    opts = parser.parse_args()
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    start = time.perf_counter()
    table = []
    for name in BENCHMARKS:
        module = importlib.import_module(name)
        if not hasattr(module, "rows"):
            continue
        kwargs = {"compile_too": not opts.no_compile}
        if "quick" in module.rows.__code__.co_varnames:
            kwargs["quick"] = opts.quick
        table.extend(module.rows(**kwargs))

    print(f"fulmen benchmarks: {platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {time.perf_counter() - start:.0f} s\n")
    print("| benchmark | unit | eager | fulmen | torch.compile | fulmen / eager "
          "| fulmen / torch.compile |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    def cell(value):
        return f"{value:.2f}" if value else "-"

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"

    for row in table:
        eager, fulmen_value, compiled = row["eager"], row["fulmen"], row.get("torch.compile")
        print(f"| {row['benchmark']} | {row['unit']} | {cell(eager)} | {cell(fulmen_value)} "
              f"| {cell(compiled)} | {ratio(fulmen_value, eager)} | {ratio(fulmen_value, compiled)} |")


if __name__ == "__main__":
    main()
