"""Minimizing a miscompile: from a failing program to a small standalone script that fails the
same way.

A program fails when `fulmen.jit(fn)` disagrees with a reference run of `fn`: eager PyTorch,
or (a cross-executor check) `fn` compiled for other executors. `failure_of` names the kind of
failure, in this order, so that shrinking keeps it:

    "error: <ExceptionType>"   the compiled run raises where the reference does not
    "metadata"                 an output's shape or dtype differs
    "value: output"            an output is less accurate than eager's (`fulmen.accuracy`)
    "layout"                   an output's strides differ
    "missing grad"             a gradient is None (or not) where the reference's is nonzero
    "value: grad"              an input gradient is less accurate than eager's

`shrink` then deletes statements of the program's first trace (the traced program, printed as
Python) while the failure keeps its kind: first it retargets the output to the earliest
statement that still fails (and drops what that does not need), then it deletes statements one
at a time, each deleted statement's outputs becoming inputs holding the values the statement
computed, so what follows sees the same values. `write_script` prints the result as a
standalone script: the trace, its input values inline, and the check; it exits 1 while the
failure reproduces. `fulmen.verify(fn, *args, minimize=True)` runs all of this and then names
the pass and statement (stage by stage) on the minimized program.

    >>> small = minimize_program(fn, x, w, executors=["codegen", "torch"])
    >>> print(small.failure, small.trace)
    >>> write_script(small, "repro.py")
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from fulmen.core import Trace
from fulmen.core.interpret import interpret
from fulmen.core.printer import print_trace
from fulmen.core.proxy import iter_proxies
from fulmen.jit import _jitted, jit
from fulmen.tools.accuracy import check_accuracy, tight, to_float64
from fulmen.tools.repro import portable_trace
from fulmen.transforms.dce import live_bsyms


@dataclass(frozen=True)
class Failure:
    """How a compiled program disagrees with its reference (see the module docstring)."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


@dataclass
class Minimized:
    """A failing program as a trace and its input values, with its failure and how it runs."""

    trace: Trace
    inputs: list
    failure: Failure
    options: dict
    runs: int = 0


def _clone(inputs):
    return [t.detach().clone().requires_grad_(t.requires_grad)
            if isinstance(t, torch.Tensor) else t for t in inputs]


def _run(fn, inputs, options):
    """`(outputs, input grads)` of `fn` (compiled with `options` unless None) on copies of
    `inputs`; grads for fixed random cotangents, None where unused."""
    inputs = _clone(inputs)
    call = fn if options is None else jit(fn, **options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        outputs = call(*inputs)
    leaves = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor)]
    wants = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    differentiable = [o for o in leaves if o.requires_grad]
    grads = []
    if wants and differentiable and torch.is_grad_enabled():
        generator = torch.Generator().manual_seed(1)
        cotangents = [torch.randn(o.shape, generator=generator).to(o.dtype)
                      for o in differentiable]
        grads = list(torch.autograd.grad(differentiable, wants, cotangents, allow_unused=True))
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in leaves], grads


def _reference64(fn, inputs):
    """`fn` run eagerly on float64 copies of the inputs, or None where it does not compute in
    float64 (it holds lower-precision tensors of its own, or fails)."""
    try:
        outputs, grads = _run(fn, to_float64(list(inputs)), None)
    except Exception:  # noqa: BLE001 - no reference then
        return None
    if any(o.is_floating_point() and o.dtype != torch.float64 for o in outputs
           if isinstance(o, torch.Tensor)):
        return None
    return outputs, grads


def _inaccurate(actual, expected, reference) -> str | None:
    """Why `actual` is less accurate than `expected` (None if it is not): the float64 rule
    against `reference()` (zeros where that is None: an unused input's gradient), or a 1e-4
    tolerance without a float64 run (`reference()` raising LookupError)."""
    if tight(actual, expected):
        return None
    try:
        wide = reference()
    except LookupError:
        close = torch.allclose(actual.double(), expected.double(), rtol=1e-4, atol=1e-5,
                               equal_nan=True)
        return None if close else "differs by more than rtol 1e-4 (no float64 run)"
    wide = torch.zeros(expected.shape, dtype=torch.float64) if wide is None else wide
    result = check_accuracy(actual, expected, wide)
    return None if result.ok else result.detail


def failure_of(fn, inputs, executors=None, transforms=None, against=None) -> Failure | None:
    """Compare `fn` compiled for `executors` (and `transforms`) with eager, or with `fn`
    compiled for `against` (a cross-executor check); return the first `Failure`, or None.

    Example:
        >>> failure_of(f, [x, w], executors=["codegen", "torch"], against=["torch"])
    """
    options = {"executors": executors, "transforms": transforms}
    try:
        expected, expected_grads = _run(fn, inputs, None if against is None else
                                        {"executors": against, "transforms": transforms})
    except Exception as error:  # noqa: BLE001 - the reference itself fails: no finding
        return None if against is None else Failure("reference error", repr(error)[:300])
    try:
        actual, grads = _run(fn, inputs, options)
    except Exception as error:  # noqa: BLE001 - any error of the compiled run is a finding
        return Failure(f"error: {type(error).__name__}", str(error)[:500])
    cache = {}

    def wide(which, index):
        if "value" not in cache:
            cache["value"] = _reference64(fn, inputs)
        if cache["value"] is None or index >= len(cache["value"][which]):
            raise LookupError("no float64 reference")
        return cache["value"][which][index]

    if len(actual) != len(expected):
        return Failure("metadata", f"{len(actual)} outputs, expected {len(expected)}")
    for index, (a, e) in enumerate(zip(actual, expected)):
        if a.shape != e.shape or a.dtype != e.dtype:
            return Failure("metadata", f"output {index}: {a.dtype}{list(a.shape)} vs "
                                       f"{e.dtype}{list(e.shape)}")
    for index, (a, e) in enumerate(zip(actual, expected)):
        why = _inaccurate(a, e, lambda i=index: wide(0, i))
        if why is not None:
            return Failure("value: output", f"output {index}: {why}")
    for index, (a, e) in enumerate(zip(actual, expected)):
        if a.numel() > 1 and a.stride() != e.stride():
            return Failure("layout", f"output {index}: strides {a.stride()} vs {e.stride()}")
    if len(grads) != len(expected_grads):
        return Failure("missing grad", f"{len(grads)} input gradients, expected "
                                       f"{len(expected_grads)}")
    for index, (g, e) in enumerate(zip(grads, expected_grads)):
        if (g is None) != (e is None) and bool((e if g is None else g).any()):
            return Failure("missing grad", f"input {index}: {'None' if g is None else 'a grad'}"
                                           f" where the reference has "
                                           f"{'None' if e is None else 'a nonzero grad'}")
        if g is not None and e is not None:
            why = _inaccurate(g, e, lambda i=index: wide(1, i))
            if why is not None:
                return Failure("value: grad", f"input {index}: {why}")
    return None


def program_of(jfn, *args, **kwargs) -> tuple[Trace, list] | None:
    """The first trace of `jfn`'s compilation for `args` (calling it once) and the values of
    its arguments in order (tensor arguments, module state, captured tensors); None when the
    program has graph breaks (a tree of segments, not one trace)."""
    jfn(*args, **kwargs)
    machinery = _jitted(jfn)
    entries = list(machinery._cache.values()) or machinery._shapes.entries  # symbolic ones
    if not entries:
        return None
    entry = entries[-1]
    if entry.tree or entry.objects:
        return None
    leaves = pytree.tree_leaves((args, kwargs))
    state = [slot.get() for slot in machinery._state_slots]
    inputs = [leaves[i] for i in entry.tensor_positions] + state + list(entry.captured)
    trace = entry.traces[0]
    if len(inputs) != len(trace.args):
        return None
    return trace, [t.detach().clone().requires_grad_(p.requires_grad)
                   if isinstance(t, torch.Tensor) else t for t, p in zip(inputs, trace.args)]


def _still_fails(trace, inputs, kind, options) -> Failure | None:
    """The failure of `trace` on `inputs`, if it has kind `kind` (any kind when None)."""
    try:
        failure = failure_of(trace.python_callable(), inputs, **options)
    except Exception:  # noqa: BLE001 - a candidate that cannot even run is no reduction
        return None
    return failure if failure is not None and kind in (None, failure.kind) else None


def _pruned(trace: Trace, inputs: list) -> tuple[Trace, list]:
    """`trace` without statements its output does not need and without unused arguments."""
    bsyms = live_bsyms(trace.bsyms, trace.output)
    used = {n for b in bsyms for n in b.input_names} | trace.output_names
    kept = [(p, v) for p, v in zip(trace.args, inputs) if p.name in used]
    return trace.replace(args=tuple(p for p, _ in kept), bsyms=bsyms,
                         provenance="minimized"), [v for _, v in kept]


def _as_inputs(trace, inputs, index) -> tuple[Trace, list] | None:
    """Statement `index` deleted: its outputs become arguments holding its values."""
    bsym = trace.bsyms[index]
    outputs = [p for p in iter_proxies(bsym.output) if isinstance(p, torch.Tensor)]
    if not outputs or len(outputs) != len(list(iter_proxies(bsym.output))):
        return None
    with torch.no_grad():
        _, env = interpret(trace, *inputs)
    values = [env[p.name].detach().clone().requires_grad_(
        p.requires_grad and env[p.name].is_floating_point()) for p in outputs]
    bsyms = trace.bsyms[:index] + trace.bsyms[index + 1:]
    return _pruned(trace.replace(args=trace.args + tuple(outputs), bsyms=bsyms),
                   list(inputs) + values)


def shrink(trace: Trace, inputs: list, failure: Failure, options: dict,
           max_runs: int = 200) -> Minimized:
    """Delete statements of `trace` while `failure_of` keeps `failure.kind` (module docstring);
    at most `max_runs` candidate runs."""
    runs = 0
    trace, inputs = _pruned(trace, inputs)
    # 1. the earliest statement whose own outputs already fail the same way
    for index, bsym in enumerate(trace.bsyms):
        if runs >= max_runs or index == len(trace.bsyms) - 1:
            break
        outputs = [p for p in iter_proxies(bsym.output) if isinstance(p, torch.Tensor)]
        if not outputs or bsym.has_side_effects:
            continue
        candidate = _pruned(trace.replace(output=tuple(outputs), bsyms=trace.bsyms[:index + 1]),
                            inputs)
        runs += 1
        found = _still_fails(*candidate, failure.kind, options)
        if found is not None:
            (trace, inputs), failure = candidate, found
            break
    # 2. delete statements one at a time, the last first (its inputs then may go too)
    index = len(trace.bsyms) - 1
    while index >= 0 and runs < max_runs:
        if len(trace.bsyms) > 1 and not trace.bsyms[index].is_del:
            candidate = _as_inputs(trace, inputs, index)
            if candidate is not None:
                runs += 1
                found = _still_fails(*candidate, failure.kind, options)
                if found is not None:
                    (trace, inputs), failure = candidate, found
        index = min(index - 1, len(trace.bsyms) - 1)
    return Minimized(trace, inputs, failure, options, runs)


def minimize_program(fn, *args, executors=None, transforms=None, against=None,
                     dynamic: bool | None = None, max_runs: int = 200) -> Minimized | None:
    """Trace `fn` on `args` (with symbolic sizes where `dynamic=True`, as `fulmen.jit`), check
    it (`failure_of`) and shrink a failure; None when the program agrees with its reference or
    cannot be taken as one trace (graph breaks)."""
    options = {"executors": executors, "transforms": transforms, "against": against}
    program = program_of(jit(fn, executors=executors, transforms=transforms, dynamic=dynamic),
                         *args)
    if program is None:
        return None
    trace, inputs = program
    failure = _still_fails(trace, inputs, None, options)
    if failure is None:
        return None
    return shrink(trace, inputs, failure, options, max_runs)


def _tensor_source(t: torch.Tensor) -> str:
    """Python building `t` exactly: values, dtype, strides and requires_grad."""
    values = t.detach().contiguous().double().flatten().tolist() if t.is_floating_point() \
        else t.detach().contiguous().flatten().tolist()
    source = (f"torch.empty_strided({tuple(t.shape)}, {tuple(t.stride())}, dtype={t.dtype})"
              f".copy_(torch.tensor({values!r}, dtype={t.dtype}).reshape({tuple(t.shape)}))")
    return source + (".requires_grad_()" if t.requires_grad else "")


def _names(items) -> str | None:
    if items is None:
        return None
    return "[" + ", ".join(repr(i) if isinstance(i, str) else
                           repr(getattr(i, "name", getattr(i, "__name__", str(i))))
                           for i in items) + "]"


def write_script(minimized: Minimized, path: str) -> str:
    """Write `minimized` as a standalone script at `path` (exits 1 while the failure of the
    same kind reproduces); return the path."""
    source = print_trace(portable_trace(minimized.trace))[0]
    options = minimized.options
    executors, against = _names(options.get("executors")), _names(options.get("against"))
    transforms = options.get("transforms")
    lines = [source, "", "import sys", ""]
    if any("codegen" in (e or "") for e in (executors, against)):
        lines.append("from fulmen.executors.codegen import set_compile_policy\n\n"
                     "set_compile_policy('eager')  # compile kernels now, not when hot")
    if transforms:
        names = ", ".join(t.__name__ for t in transforms)
        lines.append(f"from fulmen.transforms import {names}")
    lines += ["from fulmen.tools.minimize import failure_of", "",
              f"KIND = {minimized.failure.kind!r}  # {minimized.failure.detail[:200]!r}",
              "INPUTS = ["] + [f"    {_tensor_source(t)}," for t in minimized.inputs] + ["]"]
    transform_list = f"[{', '.join(t.__name__ for t in transforms)}]" if transforms else None
    lines.append(f'''
if __name__ == "__main__":
    failure = failure_of({minimized.trace.name}, INPUTS, executors={executors},
                         transforms={transform_list}, against={against})
    print(failure or "no failure")
    sys.exit(1 if failure is not None and failure.kind == KIND else 0)
''')
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        handle.write("\n".join(lines))
    return path


__all__ = ["Failure", "Minimized", "failure_of", "minimize_program", "program_of", "shrink",
           "write_script"]
