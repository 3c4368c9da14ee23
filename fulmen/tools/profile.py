"""`fulmen.profile`: where the time of one call (and its backward) goes, statement by statement.

    prof = fulmen.profile(jmodel, x)      # forward, and backward when the output requires grad
    print(prof)                           # the table; prof.rows / prof.totals for code
    fulmen.profile(jmodel, step=train_step, clock="cpu")   # a whole step, in CPU time

The compiled callables of a jitted function are the printed execution traces. For the profile,
each one's code object is swapped (for the duration of the measured steps only) for a copy whose
every top-level statement is wrapped in two `time.perf_counter()` reads; the statements, their
callables and their arguments stay exactly those of the normal run. Every statement gets one row
named as the trace prints it (`t12 = codegen.fusion4(t9, w)`), in a category:

- `fused kernel`: a fusion executor's region (`codegen.fusionN`);
- `matmul`: matrix products and convolutions (`matmul`, `linear`, `mm`, `bmm`, `addmm`, ...);
- `opaque`: ops run under `torch.autograd` (`autograd_forward`/`autograd_backward`/`autograd_vjp`);
- `torch op`: every other statement that calls something (views, copies, `full`, ...);
- `free (del)`: `del` statements (a tensor's storage may be released there);
- `host overhead`: the step's time minus all statement times: the jitted call (cache key,
  guards, autograd.Function, trace tree), the loss and the autograd engine (and whatever else a
  `step` runs: an optimizer), and the timers' own cost.

On CPU a statement's time is its host dispatch plus its kernel, measured together. Times are
seconds per step: the median over `steps` steps (taken after `warmup` steps, which also wait for
the lazily compiled codegen kernels) of each statement and of the whole step, so a preemption on
a shared machine does not land on one statement; host overhead is the median step minus the sum
of the statement medians. Each statement's time leaves out what reading the clock twice costs
with no statement between (measured before the steps): 0.05 µs for the wall clock, about 1 µs
for the CPU clock, which would otherwise swell a trace of hundreds of views and `del`s.

The clock (`clock=`): `"wall"` (`time.perf_counter`, the default) or `"cpu"` (`time.process_time`:
the CPU time of this process, all its threads). On a machine shared with other work, wall time
also counts the time other processes hold the cores (a step measured twice can differ by 2x),
CPU time far less; it leaves out time spent waiting (sleeps, I/O, a thread waiting for another).

A whole step (`step=`): by default a step is `jfn(*args, **kwargs)` and the backward of the sum
of its outputs that require grad. A training step with its loss and optimizer is profiled as
`fulmen.profile(jfn, step=train_step)`, `train_step()` calling `jfn` itself; the statements of
the traces `jfn` runs get their rows, and the rest of the step (the loss computed outside, the
optimizer, `zero_grad`) is in host overhead.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import linecache
import re
import statistics
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.core import Trace
from fulmen.core.symbol import BoundSymbol
from fulmen.core.trace import bind_callables
from fulmen.executors.codegen import wait_for_kernels
from fulmen.jit import _jitted

CATEGORIES = ("fused kernel", "matmul", "opaque", "torch op", "free (del)", "host overhead")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_MATMUL = re.compile(r"(^|[._])(matmul|linear|mm|bmm|addmm|addmv|baddbmm|addbmm|einsum|"
                     r"conv\w*|_addmm_activation)$")


@dataclass(frozen=True)
class ProfileRow:
    """One statement: `phase` ('forward'/'backward'), the trace's name, the statement as printed,
    its category, seconds per step, the share of the step and the user's source line it came
    from (`model.py:12  y = ...`, empty when unknown)."""

    phase: str
    trace: str
    statement: str
    category: str
    seconds: float
    share: float
    source: str = ""


@dataclass(frozen=True)
class Profile:
    """The result of `fulmen.profile`; `str(profile)` is the table.

    Attributes:
        rows: one per statement of every execution trace run, slowest first.
        totals: seconds per step by category (`CATEGORIES`), host overhead included.
        step_seconds: median time of one instrumented step.
        plain_step_seconds: median time of one step without instrumentation (same run).
        steps: how many steps were measured (statement and step times are medians).
        clock: `"wall"` or `"cpu"`, what the times are (module docstring).
    """

    rows: tuple[ProfileRow, ...]
    totals: dict[str, float]
    step_seconds: float
    plain_step_seconds: float
    steps: int
    clock: str = "wall"

    def table(self, limit: int | None = 40, width: int = 90) -> str:
        """The profile as markdown: totals per category, then the `limit` slowest statements."""
        step = self.step_seconds
        kind = "wall time" if self.clock == "wall" else "CPU time"
        lines = [f"fulmen.profile: {self.steps} steps, {step * 1e3:.3f} ms per instrumented step "
                 f"({self.plain_step_seconds * 1e3:.3f} ms without instrumentation), {kind}",
                 "",
                 "| category | ms per step | share | statements |", "| --- | ---: | ---: | ---: |"]
        counts = {c: sum(row.category == c for row in self.rows) for c in CATEGORIES}
        for category in CATEGORIES:
            seconds = self.totals.get(category, 0.0)
            count = counts[category] if category != "host overhead" else ""
            lines.append(f"| {category} | {seconds * 1e3:.3f} | {seconds / step:.1%} | {count} |")
        lines.append(f"| total | {sum(self.totals.values()) * 1e3:.3f} | 100% | "
                     f"{len(self.rows)} |")
        shown = self.rows if limit is None else self.rows[:limit]
        lines += ["", "| phase | statement | category | ms per step | share |",
                  "| --- | --- | --- | ---: | ---: |"]
        for row in shown:
            text = row.statement if len(row.statement) <= width else row.statement[:width - 3] + "..."
            text = text.replace("|", "\\|")
            lines.append(f"| {row.phase} | `{text}` | {row.category} | {row.seconds * 1e3:.3f} "
                         f"| {row.share:.1%} |")
        if limit is not None and len(self.rows) > limit:
            rest = sum(row.seconds for row in self.rows[limit:])
            lines.append(f"| | ({len(self.rows) - limit} more statements) | | {rest * 1e3:.3f} "
                         f"| {rest / step:.1%} |")
        return "\n".join(lines)

    def by_source(self, limit: int | None = 20, width: int = 100) -> str:
        """Markdown: seconds per step of the user's source lines (forward and backward
        statements that came from each line), slowest first."""
        totals: dict[str, list] = {}
        for row in self.rows:
            entry = totals.setdefault(row.source or "(no source line)", [0.0, 0])
            entry[0] += row.seconds
            entry[1] += 1
        ranked = sorted(totals.items(), key=lambda item: -item[1][0])
        lines = ["| source line | ms per step | share | statements |",
                 "| --- | ---: | ---: | ---: |"]
        for source, (seconds, count) in ranked if limit is None else ranked[:limit]:
            text = source if len(source) <= width else source[:width - 3] + "..."
            text = text.replace("|", "\\|")
            lines.append(f"| `{text}` | {seconds * 1e3:.3f} | {seconds / self.step_seconds:.1%} "
                         f"| {count} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.table())


def profile(jfn, *args, steps: int = 10, warmup: int = 3, step: Callable[[], Any] | None = None,
            clock: str = "wall", **kwargs) -> Profile:
    """Run `jfn(*args, **kwargs)` (and, when an output requires grad, the backward of the sum of
    the outputs), or `step()` when given, and attribute the time of a step to each statement of
    the execution traces of `jfn`.

    `steps`, `warmup`, `step` and `clock` are taken by the profile, every other keyword goes to
    `jfn`. `step`: a callable of no arguments that runs one step calling `jfn` itself (a training
    step with its loss and optimizer); then `args` and `kwargs` must be empty. `clock`: `"wall"`
    or `"cpu"` (module docstring). Gradients accumulate into `.grad` as in repeated eager steps.

    Example:
        >>> jmodel = fulmen.jit(model)
        >>> print(fulmen.profile(jmodel, x))      # ms per step by category and by statement
        >>> def train_step():
        ...     optimizer.zero_grad()
        ...     F.cross_entropy(jmodel(x), y).backward()
        ...     optimizer.step()
        >>> print(fulmen.profile(jmodel, step=train_step, clock="cpu"))

    Returns:
        A `Profile`; times in seconds per step (the table prints milliseconds).
    """
    if clock not in CLOCKS:
        raise ValueError(f"fulmen.profile: clock must be one of {sorted(CLOCKS)}, not {clock!r}")
    if step is not None and (args or kwargs):
        raise ValueError("fulmen.profile: with step=, the step calls jfn itself; pass no "
                         "arguments for jfn")
    now = CLOCKS[clock]
    if step is None:
        def step():
            out = jfn(*args, **kwargs)
            leaves = [leaf for leaf in pytree.tree_leaves(out)
                      if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
            if leaves and torch.is_grad_enabled():
                sum(leaf.sum() for leaf in leaves).backward()
            return out

    for _ in range(max(warmup, 1)):
        step()
    compiled = _compiled_functions(_jitted(jfn))
    wait_for_kernels(*execution_traces(jfn))
    step()

    swaps = [_Instrumented(fn) for fn in compiled]
    plain, timed = [], []
    for _ in range(steps):  # alternate: a change in the machine's load hits both alike
        start = now()
        step()
        plain.append(now() - start)
        for swap in swaps:
            swap.install(now)
        try:
            start = now()
            step()
            timed.append(now() - start)
        finally:
            for swap in swaps:
                swap.remove()

    total = statistics.median(timed)
    reading = _clock_cost(now)
    rows = []
    for swap in swaps:
        if not any(any(times) for times in swap.steps):
            continue  # another specialisation or branch, not run by this call
        for label, category, seconds, source in swap.results(reading):
            rows.append(ProfileRow(swap.phase, swap.trace.name, label, category, seconds,
                                   seconds / total, source))
    rows.sort(key=lambda row: -row.seconds)
    totals = {category: 0.0 for category in CATEGORIES}
    for row in rows:
        totals[row.category] += row.seconds
    totals["host overhead"] = total - sum(row.seconds for row in rows)
    return Profile(tuple(rows), totals, total, statistics.median(plain), steps, clock)


def _clock_cost(now: Callable[[], float], samples: int = 201) -> float:
    """What `now() - start` measures around no statement at all (the instrumented code's
    `_fulmen_t = now()` then `... += now() - _fulmen_t`): the median of `samples` readings."""
    readings = []
    for _ in range(samples):
        start = now()
        readings.append(now() - start)
    return statistics.median(readings)


class _Instrumented:
    """A compiled trace function and a copy of its code that times every statement."""

    def __init__(self, fn: types.FunctionType) -> None:
        self.fn = fn
        self.trace: Trace = fn.__fulmen_trace__
        self.phase = "backward" if self.trace.name.startswith("backward") else "forward"
        self.plain_code = fn.__code__
        source_lines = linecache.getlines(fn.__code__.co_filename)
        module = ast.parse("".join(source_lines))
        func = next(node for node in module.body if isinstance(node, ast.FunctionDef))
        body = [stmt for stmt in func.body if not isinstance(stmt, ast.Return)]
        # the printer writes one statement per bound symbol, in order (comments are not code)
        bsyms = self.trace.bsyms if len(self.trace.bsyms) == len(body) else [None] * len(body)
        self.labels = [_label(source_lines[stmt.lineno - 1]) for stmt in body]
        self.sources = [" ".join(str(bsym.source).split()) if bsym is not None
                        and bsym.source is not None else "" for bsym in bsyms]
        self.categories = [_category(bsym, stmt, label)
                           for bsym, stmt, label in zip(bsyms, body, self.labels)]
        self.steps: list[list[float]] = []  # seconds per statement, one list per step
        new_body = []
        for index, stmt in enumerate(body):
            new_body += ast.parse("_fulmen_t = _fulmen_clock()").body
            new_body.append(stmt)
            new_body += ast.parse(
                f"_fulmen_times[{index}] += _fulmen_clock() - _fulmen_t").body
        returns = [stmt for stmt in func.body if isinstance(stmt, ast.Return)]
        func.body = new_body + returns
        module.body = [func]
        ast.fix_missing_locations(module)
        # the callables bound as in the plain run (NOTE [bound callables] in core/trace.py)
        code = compile(bind_callables(module, fn.__globals__), fn.__code__.co_filename, "exec")
        self.timed_code = next(const for const in code.co_consts
                               if isinstance(const, types.CodeType) and const.co_name == func.name)

    def install(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.fn.__globals__["_fulmen_clock"] = now
        self.steps.append([0.0] * len(self.labels))
        self.fn.__globals__["_fulmen_times"] = self.steps[-1]
        self.fn.__code__ = self.timed_code

    def remove(self) -> None:
        self.fn.__code__ = self.plain_code

    def results(self, reading: float = 0.0) -> list[tuple[str, str, float, str]]:
        """`(statement, category, median seconds over the steps, source)` per statement, less
        `reading` (the clock's own cost within each statement's time), never below 0."""
        medians = [max(statistics.median(times) - reading, 0.0)
                   for times in zip(*self.steps)] if self.steps else [0.0] * len(self.labels)
        return list(zip(self.labels, self.categories, medians, self.sources))


def _label(line: str) -> str:
    """A statement's line without its indentation and type comment."""
    code = line.strip()
    cut = code.find("  # ")
    return code[:cut] if cut >= 0 else code


def _category(bsym, stmt: ast.stmt, label: str) -> str:
    if isinstance(stmt, ast.Delete):
        return "free (del)"
    if bsym is not None and "fusion" in bsym.sym.tags:
        return "fused kernel"
    value = getattr(stmt, "value", None)
    callee = ast.unparse(value.func) if isinstance(value, ast.Call) else label
    if callee.endswith(("autograd_forward", "autograd_backward", "autograd_vjp")):
        return "opaque"
    if _MATMUL.search(callee):
        return "matmul"
    if bsym is None and re.search(r"\.fusion\d+$", callee):
        return "fused kernel"
    return "torch op"


def execution_traces(jfn) -> list[Trace]:
    """The execution traces every compiled specialisation of `jfn` runs (forward and backward,
    every segment of programs with graph breaks), e.g. to wait for their kernels:
    `fulmen.executors.codegen.wait_for_kernels(*execution_traces(jfn))`."""
    return [fn.__fulmen_trace__ for fn in _compiled_functions(_jitted(jfn))]


def _compiled_functions(jitted) -> list[types.FunctionType]:
    """Every compiled trace function (`Trace.python_callable`) reachable from the cache
    entries: through partials, `without_autocast` wrappers, compiled pairs and trace trees."""
    found: dict[int, types.FunctionType] = {}
    seen: set[int] = set()
    stack: list[Any] = [entry.fn for entry in jitted._cache.values()]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (Trace, BoundSymbol, torch.Tensor, str)):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            if hasattr(obj, "__wrapped__"):  # functools.wraps copies __fulmen_trace__ too
                stack.append(obj.__wrapped__)
            elif hasattr(obj, "__fulmen_trace__"):
                found[id(obj)] = obj
        elif isinstance(obj, functools.partial):
            stack += [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            stack += [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        elif type(obj).__module__.startswith("fulmen") and hasattr(obj, "__dict__"):
            stack += list(vars(obj).values())
    return list(found.values())


__all__ = ["CATEGORIES", "CLOCKS", "Profile", "ProfileRow", "execution_traces", "profile"]
