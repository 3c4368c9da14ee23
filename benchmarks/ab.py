"""A/B: one fulmen tree against another on the same cases, on a shared, noisy machine.

Each measurement runs in a subprocess importing one tree (`PYTHONPATH`), which times eager and
fulmen in alternating rounds and reports the median over rounds of fulmen's time divided by
eager's (wall and process CPU time): load that changes during a run hits both alike. The trees
alternate, old-new then new-old, for `--procs` processes each; the table gives the medians of
those ratios per tree and the load average seen. Compare the ratio columns, not the µs.

Cases: `ten` (the 10-op elementwise function on 8x8, no grad), `mod` (8 x (Linear(16, 16) +
ReLU) on (4, 16), no grad), and `MODEL:train` / `MODEL:infer` for the models of
`benchmarks/e2e.py` (tiny configs: llama, gpt2, bert, t5, pythia-14m, linear-relu). 1 thread.

`--steady-heap`: the workers run with glibc's heap kept (`STEADY_HEAP`; why in
`benchmarks/e2e.py`), so page faults from memory given back do not decide pythia-14m's ratios.

Run: `python benchmarks/ab.py OLD_TREE NEW_TREE --cases ten,mod,llama:train --procs 2`
(a tree is a checkout's root, e.g. one made by `git worktree add` or `git archive | tar -x`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# glibc's tunables, read at process start: a heap never trimmed and an mmap threshold that stays
# at 32 MiB (setting only one of them fixes the threshold at its 128 KiB default: every large
# block then comes from mmap, faulting each time)
STEADY_HEAP = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def worker(case: str, rounds: int, number: int) -> dict:
    """Median per-round ratios of fulmen to eager for `case`, in this process's tree."""
    import torch

    torch.set_num_threads(1)
    import fulmen

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    torch.manual_seed(0)
    if case in ("ten", "mod"):
        from overhead import linear_relu, ten_ops, warm_up

        fn = linear_relu() if case == "mod" else ten_ops
        args = (torch.randn(4, 16),) if case == "mod" else (torch.randn(8, 8), torch.randn(8, 8))
        jfn = fulmen.jit(fn)
        torch.set_grad_enabled(False)
        warm_up(jfn, args)
        steps = {"eager": lambda: fn(*args), "fulmen": lambda: jfn(*args)}
    else:
        import e2e

        name, mode = case.split(":")
        spec = e2e.make_cases("tiny", [name])[0]
        model = spec.model
        jmodel = fulmen.jit(model)
        train, infer = e2e.step_functions(spec)
        step = train if mode == "train" else infer
        model.train(mode == "train")
        steps = {"eager": lambda: step(model), "fulmen": lambda: step(jmodel)}
        e2e._warm(jmodel, steps["fulmen"])
        e2e._warm(model, steps["eager"])
    wall, cpu, times = [], [], []
    for _ in range(rounds):
        took = {}
        for label, run in steps.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(number):
                run()
            took[label] = ((time.perf_counter() - start) / number,
                           (time.process_time() - start_cpu) / number)
        wall.append(took["fulmen"][0] / took["eager"][0])
        cpu.append(took["fulmen"][1] / took["eager"][1])
        times.append((took["eager"][0] * 1e6, took["fulmen"][0] * 1e6))
    return {"wall": statistics.median(wall), "cpu": statistics.median(cpu),
            "eager_us": statistics.median(t[0] for t in times),
            "fulmen_us": statistics.median(t[1] for t in times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--cases", default="ten,mod")
    parser.add_argument("--procs", type=int, default=2, help="processes per tree")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=0,
                        help="calls per round (default: 1000 for ten/mod, 10 for models)")
    parser.add_argument("--steady-heap", action="store_true",
                        help="workers keep glibc's heap (no trimming, fixed mmap threshold)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        print(json.dumps(worker(opts.worker, opts.rounds, opts.number)))
        return
    print("| case | old fulmen/eager (wall, cpu) | new fulmen/eager (wall, cpu) "
          "| old µs (eager, fulmen) | new µs (eager, fulmen) | load |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in opts.cases.split(","):
        number = opts.number or (1000 if case in ("ten", "mod") else 10)
        results: dict[str, list[dict]] = {"old": [], "new": []}
        loads = []
        for p in range(opts.procs):
            order = (("old", opts.old), ("new", opts.new))
            for label, tree in order if p % 2 == 0 else order[::-1]:
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS="1")
                if opts.steady_heap:
                    env.update(STEADY_HEAP)
                script = os.path.join(os.path.abspath(tree), "benchmarks", "ab.py")
                if not os.path.exists(script):  # an old tree without this file: use ours
                    script = os.path.abspath(__file__)
                out = subprocess.run([sys.executable, script, "x", "y", "--worker", case,
                                      "--rounds", str(opts.rounds), "--number", str(number)],
                                     env=env, capture_output=True, text=True, cwd=tree)
                if out.returncode != 0:
                    raise RuntimeError(f"{case} in {tree} failed:\n{out.stderr[-3000:]}")
                results[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
                loads.append(os.getloadavg()[0])

        def med(label, key, results=results):
            return statistics.median(r[key] for r in results[label])

        print(f"| {case} | {med('old', 'wall'):.3f}, {med('old', 'cpu'):.3f} "
              f"| {med('new', 'wall'):.3f}, {med('new', 'cpu'):.3f} "
              f"| {med('old', 'eager_us'):.1f}, {med('old', 'fulmen_us'):.1f} "
              f"| {med('new', 'eager_us'):.1f}, {med('new', 'fulmen_us'):.1f} "
              f"| {min(loads):.2f}-{max(loads):.2f} |", flush=True)


if __name__ == "__main__":
    main()
