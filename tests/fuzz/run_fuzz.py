"""`make fuzz`: every generator with a large budget, campaign style (a failure is tallied and
the run goes on), then a summary table in `tests/fuzz/SUMMARY.md`.

    .venv/bin/python -m tests.fuzz.run_fuzz [TOTAL] [--seed N] [--only NAME,NAME]

    .venv/bin/python -m tests.fuzz.run_fuzz 100000 --jobs 7   # one process per generator

TOTAL (default 100,000 programs, or FULMEN_FUZZ_PROGRAMS) is split by `SHARE`: most of it to
the op-level programs (`programs.py`, each checked also with in-place updates of its inputs)
under `["torch"]` and decomposed to prims, 5% traced with symbolic sizes (`dynamic=True`, each
program's jitted function called again at 1-4 other sizes; a fifth of them under codegen), 3%
under codegen (each new kernel is a C++ build), a tenth to programs with graph breaks (`test_break_programs.py`), 2% to whole models
in calling contexts (`models.py`; a tenth of those with `dynamic=True`, 2-3 calls at changing
sizes). Measured (2,000-program run, `--jobs 2` on a 2-core machine shared with other
work, load ~5): ~47 ms per op program (torch), ~49 ms (decomposed), ~1.6 s (codegen, cold
kernel cache), ~370 ms per break program, ~3-4 s per model case (~11 s under codegen, cold).
So 100,000 programs take ~6.5 h in one process there; `--jobs 7` with 7 free cores takes
about the longest generator, ~1.6 h (models under codegen). See SUMMARY.md. `make test` runs the same generators with small budgets (`test_fuzz.py`,
`test_break_programs.py`, `test_models.py`).

For each failure kind, the first failing program is reduced: op-level programs and first calls
of model cases by statement deletion on their trace (`fulmen.minimize`; a standalone script
under FULMEN_FUZZ_FINDINGS, default $TMPDIR/fulmen_fuzz_findings), model cases also by
`model_check.minimize`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import traceback
from collections import Counter

from hypothesis import HealthCheck, given, seed, settings

from tests.environment import apply_test_environment

SHARE = {  # generator -> fraction of the total budget (see the module docstring for times)
    "ops: torch": 0.40, "ops: decomposed": 0.40, "ops: codegen": 0.03, "ops: dynamic": 0.04,
    "ops: dynamic_codegen": 0.01, "breaks": 0.10,
    "models: torch": 0.008, "models: decomposed": 0.005, "models: codegen": 0.005,
    "models: dynamic": 0.002,
}  # fmt: skip
FINDINGS = os.environ.get("FULMEN_FUZZ_FINDINGS") or os.path.join(tempfile.gettempdir(),
                                                                   "fulmen_fuzz_findings")


@dataclasses.dataclass
class Tally:
    """What one generator's campaign saw."""

    name: str
    programs: int = 0
    mismatches: int = 0
    skipped: int = 0  # programs eager itself rejects
    seconds: float = 0.0
    kinds: Counter = dataclasses.field(default_factory=Counter)
    examples: list = dataclasses.field(default_factory=list)  # (kind, text), first per kind


def _record(tally: Tally, kind: str, text: str) -> None:
    tally.mismatches += 1
    tally.kinds[kind] += 1
    if tally.kinds[kind] == 1:
        tally.examples.append((kind, text))
        print(f"[{tally.name}] FAIL {kind}: {text[:400]}", flush=True)


def _campaign(strategy, examples: int, body, seed_value: int):
    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(value):
        body(value)

    run()


def _op_programs(tally: Tally, config: str, examples: int, seed_value: int) -> None:
    import torch

    from fulmen.tools.minimize import minimize_program, write_script
    from tests.fuzz.programs import programs
    from tests.fuzz.test_fuzz import CONFIGS, EDGE_VALUES, SHAPE_CALLS, check_program

    # the generated kernels, not the torch fallback of cold regions ("dynamic_codegen" follows
    # FULMEN_CODEGEN_COMPILE: lazy by default, a region's kernel taking over mid-sequence)
    if config == "codegen":
        from fulmen.executors.codegen import set_compile_policy

        set_compile_policy("eager")

    def body(program):
        if config not in EDGE_VALUES:
            program = dataclasses.replace(program, values="normal")
        tally.programs += 1
        try:
            check_program(program, CONFIGS[config])
        except Exception as error:  # noqa: BLE001 - every failure is tallied
            kind = f"{type(error).__name__}: {str(error).splitlines()[0][:60]}"
            first = kind not in tally.kinds
            text = f"{program!r}\n{error}"
            if first:
                text += _minimized_op_program(program, config, minimize_program, write_script,
                                              torch)
            _record(tally, kind, text)

    _campaign(programs(calls=config in SHAPE_CALLS), examples, body, seed_value)


def _minimized_op_program(program, config, minimize_program, write_script, torch) -> str:
    from tests.fuzz.test_fuzz import CONFIGS

    requires_grad = program.dtype in (torch.float32, torch.float64)
    inputs = program.make_inputs(0, requires_grad)
    try:
        small = minimize_program(lambda *xs: program.run(*xs)[0], *inputs, **CONFIGS[config])
    except Exception:  # noqa: BLE001
        return "\n(trace minimization failed:\n" + traceback.format_exc()[-800:] + ")"
    if small is None:
        return "\n(the traced program alone does not fail by the float64 rule)"
    path = write_script(small, os.path.join(FINDINGS, f"ops_{config}_{id(small)}.py"))
    return f"\nminimized ({small.failure}), script {path}:\n{small.trace}"


def _break_programs(tally: Tally, examples: int, seed_value: int) -> None:
    from hypothesis import strategies as st

    from tests.fuzz.test_break_programs import SEEDS, STEPS, check_break_program

    def body(value):
        steps, seeds = value
        tally.programs += 1
        try:
            check_break_program(steps, seeds)
        except Exception as error:  # noqa: BLE001
            _record(tally, type(error).__name__, f"steps={steps!r} seeds={seeds!r}\n{error}")

    _campaign(st.tuples(STEPS, SEEDS), examples, body, seed_value)


def _models(tally: Tally, config: str, examples: int, seed_value: int) -> None:
    from tests.fuzz.model_cases import cases
    from tests.fuzz.model_check import MIN_CALLS, InvalidCase, failure_of
    from tests.fuzz.test_models import _report

    if config == "codegen":
        from fulmen.executors.codegen import set_compile_policy

        set_compile_policy("eager")

    def body(case):
        tally.programs += 1
        try:
            failure = failure_of(case, config)
        except InvalidCase:
            tally.skipped += 1
            return
        if failure is not None:
            first = failure.kind not in tally.kinds
            _record(tally, failure.kind, _report(case, failure, config) if first else repr(case))

    _campaign(cases(MIN_CALLS.get(config, 1)), examples, body, seed_value)


def run_generator(name: str, examples: int, seed_value: int = 0) -> Tally:
    """One generator's campaign of `examples` programs, under the tests' FULMEN_* settings
    (`tests/environment.py`: codegen generators fuse tiny regions too, as `make test` does)."""
    apply_test_environment()
    tally = Tally(name)
    start = time.time()
    family, _, config = name.partition(": ")
    if family == "ops":
        _op_programs(tally, config, examples, seed_value)
    elif family == "breaks":
        _break_programs(tally, examples, seed_value)
    else:
        _models(tally, config, examples, seed_value)
    tally.seconds = time.time() - start
    print(f"[{name}] {tally.programs} programs, {tally.mismatches} mismatches, "
          f"{tally.seconds:.0f} s", flush=True)
    return tally


def run(total: int, seed_value: int = 0, only=None, jobs: int = 1) -> list[Tally]:
    """Run every generator (or those named in `only`) with its share of `total`, in `jobs`
    processes."""
    work = [(name, max(1, round(total * share)), seed_value) for name, share in SHARE.items()
            if not only or name in only]
    if jobs <= 1:
        return [run_generator(*item) for item in work]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")  # no forked torch/OpenMP state
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        return list(pool.map(run_generator, *zip(*work)))


def summary(tallies: list[Tally], total: int, seed_value: int) -> str:
    """The Markdown summary: one row per generator, then the first failure of each kind."""
    lines = ["# Fuzzing summary (`make fuzz`)", "",
             f"Budget {total:,} programs, hypothesis seed {seed_value}; written by "
             "`tests/fuzz/run_fuzz.py`.", "",
             "| generator | programs | mismatches | skipped (eager rejects) | seconds | "
             "ms / program |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for t in tallies:
        per = 1e3 * t.seconds / max(t.programs, 1)
        lines.append(f"| {t.name} | {t.programs:,} | {t.mismatches} | {t.skipped} | "
                     f"{t.seconds:.0f} | {per:.0f} |")
    programs = sum(t.programs for t in tallies)
    lines.append(f"| **all** | **{programs:,}** | **{sum(t.mismatches for t in tallies)}** | "
                 f"{sum(t.skipped for t in tallies)} | {sum(t.seconds for t in tallies):.0f} |"
                 " |")
    for t in tallies:
        for kind, text in t.examples:
            lines += ["", f"## {t.name}: {kind} ({t.kinds[kind]}x)", "", "```", text, "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("total", nargs="?", type=int,
                        default=int(os.environ.get("FULMEN_FUZZ_PROGRAMS", "100000")))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated generator names")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("FULMEN_FUZZ_JOBS", "1")),
                        help="generators run side by side in this many processes")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "SUMMARY.md"))
    args = parser.parse_args(argv)
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    tallies = run(args.total, args.seed, only, args.jobs)
    text = summary(tallies, args.total, args.seed)
    with open(args.out, "w") as handle:
        handle.write(text)
    print(text)
    return 1 if any(t.mismatches for t in tallies) else 0


if __name__ == "__main__":
    sys.exit(main())
