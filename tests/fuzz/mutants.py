"""Mutation testing: plant a known miscompile in a copy of fulmen and check a test subset fails.

Each `Mutant` (the table lives in `tests/fuzz/mutant_table.py`) is one small source edit: an
exact string of a file under `fulmen/` that must occur exactly once, and its replacement. For
every mutant the harness copies `fulmen/`, `tests/` and `pyproject.toml` into a temporary
directory, applies the edit to the copy, and runs the mutant's pytest subset there (`-x`, with
that directory first on `PYTHONPATH` and as the working directory, so `import fulmen` is the
mutated copy; the worktree is never modified). A mutant is *killed* when the subset fails
(pytest exit code 1, or 2 for an error while collecting) and *survives* when it passes; a
subset that collects no test (exit code 5) or an edit that does not apply is a harness error.
Before the mutants, `--baseline` runs every distinct subset on an unmutated copy, which must
pass (else a kill means nothing).

    python -m tests.fuzz.mutants                      # every mutant, table on stdout
    python -m tests.fuzz.mutants --only vjp_mul_swap  # some of them (names or areas)
    python -m tests.fuzz.mutants --only vjp_mul_swapped --tests tests/x.py::test_y
    python -m tests.fuzz.mutants --write tests/fuzz/MUTANTS.md --baseline
    make mutants                                      # the last line, at nice 10

A subset is chosen per mutant (the tests that cover its area, a few seconds to a minute), so a
survivor means "that subset misses it", not necessarily the whole `make test`: a survivor is
worth a focused test that compares the behaviour with eager (see MUTANTS.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["Mutant", "Result", "apply_mutant", "run_mutant"]


@dataclass(frozen=True)
class Mutant:
    """One planted bug: replace `old` (occurring exactly once in `fulmen/<path>`) by `new`;
    `tests` are the pytest arguments (files, node ids, `-k` filters) of the subset that should
    kill it."""

    name: str
    area: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    note: str = ""


@dataclass
class Result:
    """How one mutant (or a baseline subset, `mutant=None`) fared."""

    name: str
    area: str
    status: str  # killed / survived / timeout / error
    seconds: float
    killed_by: str = ""
    detail: str = ""


def apply_mutant(package: Path, mutant: Mutant) -> None:
    """Apply `mutant` to the copy of fulmen at `package`.

    Raises:
        ValueError: if `mutant.old` does not occur exactly once in the file.
    """
    target = package / mutant.path
    text = target.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise ValueError(f"{mutant.name}: the text to replace occurs {count} times in "
                         f"fulmen/{mutant.path}")
    target.write_text(text.replace(mutant.old, mutant.new))


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    shutil.copytree(ROOT / "fulmen", dest / "fulmen", ignore=ignore)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _first_failure(output: str) -> str:
    """The first failing test id pytest -q reports ("FAILED tests/x.py::test - ...")."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0]
    return ""


def run_mutant(mutant: Mutant | None, tests: tuple[str, ...], timeout: float,
               name: str = "", area: str = "") -> Result:
    """Run `tests` against a copy of fulmen with `mutant` applied (None: unmutated)."""
    name = mutant.name if mutant else name
    area = mutant.area if mutant else area
    with tempfile.TemporaryDirectory(prefix="fulmen-mutant-") as tmp:
        root = Path(tmp)
        _copy_tree(root)
        if mutant is not None:
            try:
                apply_mutant(root / "fulmen", mutant)
            except ValueError as error:
                return Result(name, area, "error", 0.0, detail=str(error))
        env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1",
                   FULMEN_MUTANT=name or "baseline")
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                   "--timeout", str(int(timeout)), *tests]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                                  timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            return Result(name, area, "timeout", time.perf_counter() - start)
        seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    if done.returncode == 0:
        return Result(name, area, "survived", seconds, detail=tail)
    if done.returncode in (1, 2):
        failure = _first_failure(output) or ("collection error" if done.returncode == 2 else "")
        return Result(name, area, "killed", seconds, killed_by=failure, detail=tail)
    return Result(name, area, "error", seconds, detail=f"pytest exit {done.returncode}: {tail}")


def _selected(mutants: list[Mutant], only: list[str]) -> list[Mutant]:
    if not only:
        return mutants
    wanted = set(only)
    chosen = [m for m in mutants if m.name in wanted or m.area in wanted]
    missing = wanted - {m.name for m in chosen} - {m.area for m in chosen}
    if missing:
        raise SystemExit(f"no mutant or area named {sorted(missing)}")
    return chosen


def check_table(mutants: list[Mutant]) -> None:
    """Every mutant applies to the current sources (its text occurs exactly once) and names
    are unique. (`main` runs the others when some do not: a stale one is an `error` row.)

    Raises:
        ValueError: naming every mutant that does not apply.
    """
    names = [m.name for m in mutants]
    if len(names) != len(set(names)):
        raise ValueError("mutant names repeat")
    problems = []
    for mutant in mutants:
        text = (ROOT / "fulmen" / mutant.path).read_text()
        if text.count(mutant.old) != 1 or mutant.old == mutant.new:
            problems.append(f"{mutant.name}: occurs {text.count(mutant.old)} times in "
                            f"fulmen/{mutant.path} (or changes nothing)")
    if problems:
        raise ValueError("; ".join(problems))


def markdown(results: list[Result], baseline: list[Result], jobs: int, wall: float) -> str:
    """The results as the table of MUTANTS.md."""
    killed = sum(r.status == "killed" for r in results)
    lines = [
        f"{killed} of {len(results)} mutants killed; {wall:.0f} s wall with --jobs {jobs} "
        f"(`nice -n 10`, shared 2-core machine).", "",
        "| mutant | area | status | killed by (first failing test) | seconds |",
        "| --- | --- | --- | --- | ---: |",
    ]
    for r in results:
        by = f"`{r.killed_by}`" if r.killed_by else (r.detail if r.status != "survived" else "")
        lines.append(f"| {r.name} | {r.area} | {r.status} | {by} | {r.seconds:.0f} |")
    if baseline:
        lines += ["", "Baseline (unmutated copy) per distinct subset:", "",
                  "| subset | status | seconds |", "| --- | --- | ---: |"]
        for r in baseline:
            lines.append(f"| `{r.name}` | {'passed' if r.status == 'survived' else r.status} "
                         f"| {r.seconds:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from tests.fuzz.mutant_table import MUTANTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="mutant names or areas")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
    parser.add_argument("--baseline", action="store_true",
                        help="first run each distinct subset unmutated (must pass)")
    parser.add_argument("--write", type=Path, help="write the markdown table here")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--tests", nargs="+", help="run this pytest subset instead of each "
                        "mutant's own (to check that a new test kills a mutant)")
    args = parser.parse_args(argv)
    try:
        check_table(MUTANTS)
    except ValueError as error:  # the sources moved: report those as errors, run the rest
        print(f"stale mutants (edit tests/fuzz/mutant_table.py): {error}")
    mutants = _selected(MUTANTS, args.only)
    if args.list:
        for m in mutants:
            print(f"{m.name:32} {m.area:14} fulmen/{m.path}  {' '.join(m.tests)}")
        return 0
    start = time.perf_counter()
    baseline: list[Result] = []
    with ThreadPoolExecutor(args.jobs) as pool:
        if args.baseline:
            subsets = [tuple(args.tests)] if args.tests else sorted({m.tests for m in mutants})
            baseline = list(pool.map(
                lambda t: run_mutant(None, t, args.timeout, name=" ".join(t)), subsets))
            for r in baseline:
                print(f"baseline {r.status:9} {r.seconds:6.1f}s  {r.name}  {r.detail}",
                      flush=True)
            if any(r.status != "survived" for r in baseline):
                print("a baseline subset fails: fix it before reading mutant results")
                return 2

        def one(m: Mutant) -> Result:
            r = run_mutant(m, tuple(args.tests or m.tests), args.timeout)
            print(f"{r.status:9} {r.seconds:6.1f}s  {m.name:32} {r.killed_by or r.detail}",
                  flush=True)
            return r

        results = list(pool.map(one, mutants))
    wall = time.perf_counter() - start
    table = markdown(results, baseline, args.jobs, wall)
    if args.write:
        args.write.write_text(args.write.read_text().split("<!-- results -->")[0]
                              + "<!-- results -->\n\n" + table
                              if args.write.exists() else table)
    else:
        print(table)
    survivors = [r.name for r in results if r.status != "killed"]
    print(f"survivors: {survivors}" if survivors else "every mutant killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
