"""`fulmen.verify`: find the first compilation stage, and the first statement in it, whose
results diverge from eager PyTorch.

Every fulmen trace is runnable Python, so each stage can be run on the same inputs:

1. run `fn` eagerly (and, when inputs require grad, its gradients for a fixed random cotangent);
2. compile it with `fulmen.jit`, then run every forward stage (and every backward stage, on the
   final forward's residuals) with the trace interpreter, comparing each with eager;
3. in the first diverging stage, compare every statement's outputs with the values the previous
   stage computed under the same names (SSA names survive passes); a statement without a
   counterpart (a fusion region) is compared with its own subsymbols run by torch;
4. write a standalone repro script for that statement: a fusion in it is fused again by its
   executor from its region (`rebuild_fusion`), so the script runs in a fresh process.

Tolerances are per dtype: `torch.testing.assert_close`'s values (x10 for gradients), and never
tighter than one unit in the last place of the dtype, also when `rtol` is given (a 1-ulp
bfloat16 difference is rounding, not a divergence). Rounding differences can grow through a
program (a sum that cancels, bfloat16 everywhere); so `fn` is also run in float64 where it can
be, and a stage's result outside the tolerance still agrees when it passes the float64 rule of
`fulmen.accuracy` (error vs float64 at most 2x eager's, 3x for float16/bfloat16, plus a small
floor; the rule of `torch._dynamo`'s accuracy checks).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from fulmen.core import BoundSymbol, Trace
from fulmen.core.interpret import interpret
from fulmen.core.printer import print_trace, statement_source
from fulmen.core.proxy import iter_proxies
from fulmen.jit import _jitted, jit
from fulmen.tools.accuracy import check_accuracy
from fulmen.tools.minimize import minimize_program, write_script
from fulmen.tools.repro import fusion_preamble, portable_statement

_TOLERANCES = {  # (rtol, atol), as torch.testing.assert_close
    torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7), torch.complex64: (1.3e-6, 1e-5), torch.complex128: (1e-7, 1e-7),
}  # fmt: skip


@dataclass
class StageCheck:
    """One stage compared with eager: `max_error` is the largest |actual - expected| seen."""

    stage: str
    ok: bool
    max_error: float
    detail: str = ""


@dataclass
class VerifyReport:
    """The result of `fulmen.verify`; `str(report)` is the human-readable account.

    `first_bad_stage` and `culprit` (the statement, as printed) are None when everything agrees;
    `repro_path` is the script reproducing the culprit's mismatch on its own.
    """

    stages: list[StageCheck] = field(default_factory=list)
    first_bad_stage: str | None = None
    culprit: str | None = None
    culprit_op: str | None = None
    repro_path: str | None = None
    minimized_failure: str | None = None
    minimized_path: str | None = None
    minimized_report: VerifyReport | None = None

    @property
    def ok(self) -> bool:
        return self.first_bad_stage is None

    def __str__(self) -> str:
        lines = ["fulmen.verify: " + ("all stages agree with eager" if self.ok else
                                      f"first divergence in stage '{self.first_bad_stage}'")]
        for check in self.stages:
            mark = "ok " if check.ok else "BAD"
            lines.append(f"  [{mark}] {check.stage:<44} max |error| {check.max_error:.3g}"
                         + (f"  {check.detail}" if check.detail else ""))
        if self.culprit:
            lines.append(f"  first diverging statement (op {self.culprit_op}):\n    {self.culprit}")
        if self.repro_path:
            lines.append(f"  repro script: {self.repro_path}")
        if self.minimized_path:
            lines.append(f"  minimized program ({self.minimized_failure}): "
                         f"{self.minimized_path}")
        if self.minimized_report is not None and not self.minimized_report.ok:
            inner = str(self.minimized_report).replace("\n", "\n  ")
            lines.append(f"  on the minimized program: {inner}")
        return "\n".join(lines)


def _tolerance(dtype, rtol, atol, scale=1.0) -> tuple[float, float]:
    """(rtol, atol) for `dtype`: the given values or the dtype's defaults, and an rtol of at
    least one ulp (`finfo.eps`) for floating dtypes; integers and bools compare exactly."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return (rtol or 0.0, atol or 0.0)
    eps = torch.finfo(dtype).eps
    default = _TOLERANCES.get(dtype, (2 * eps, 1e-5))
    chosen_rtol = rtol if rtol is not None else default[0] * scale
    chosen_atol = atol if atol is not None else default[1] * scale
    return max(chosen_rtol, eps), chosen_atol


def _close(a: torch.Tensor, e: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float]:
    """Whether |a - e| <= atol + rtol * |e| everywhere (NaN matching NaN, infinities matching),
    computed in float64 so low-precision dtypes do not round the check; and the worst error."""
    if not a.numel():
        return True, 0.0
    a64, e64 = a.detach().to(torch.complex128 if a.is_complex() else torch.float64), \
        e.detach().to(torch.complex128 if e.is_complex() else torch.float64)
    diff = (a64 - e64).abs()
    both_nan = torch.isnan(a64) & torch.isnan(e64)
    same = (a64 == e64) | both_nan  # equal infinities too
    diff = torch.where(same, 0, diff)
    worst = float(diff.nan_to_num(float("inf")).max())
    ok = bool(((diff <= atol + rtol * e64.abs()) | same).all())
    return ok, worst


def _as_accurate(a: torch.Tensor, e: torch.Tensor, reference) -> bool:
    """Whether `a` is as accurate as eager's `e` by the float64 rule (`fulmen.accuracy`):
    against the float64 `reference`, at most 2x eager's error (3x for float16/bfloat16) plus
    a small floor. False without a usable reference."""
    if not isinstance(reference, torch.Tensor) or not e.is_floating_point():
        return False
    return check_accuracy(a, e, reference).ok


def _compare(actual, expected, rtol, atol, scale=1.0, reference=None) -> tuple[bool, float, str]:
    """Compare two pytrees of tensors/values; return (ok, max error, detail). `reference`, when
    given, is `expected` computed in float64 (see the module docstring)."""
    act, exp = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    if len(act) != len(exp):
        return False, float("inf"), f"{len(act)} outputs, expected {len(exp)}"
    refs = pytree.tree_leaves(reference) if reference is not None else []
    if len(refs) != len(exp):
        refs = [None] * len(exp)
    worst = 0.0
    for index, (a, e) in enumerate(zip(act, exp)):
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            if a.shape != e.shape or a.dtype != e.dtype:
                return False, float("inf"), f"output {index}: {a.dtype}{list(a.shape)} vs " \
                                            f"{e.dtype}{list(e.shape)}"
            r, t = _tolerance(e.dtype, rtol, atol, scale)
            ok, error = _close(a, e, r, t)
            worst = max(worst, error)
            if not ok and not _as_accurate(a, e, refs[index]):
                return False, worst, f"output {index} differs"
        elif (e is None) != (a is None) or (e is not None and not isinstance(e, torch.Tensor)
                                            and a != e):
            return False, float("inf"), f"output {index}: {a!r} vs {e!r}"
    return True, worst, ""


def check_repro(actual, expected) -> int:
    """What a repro script ends with: print the largest difference between the region's and
    the reference's outputs; return the exit status (1 when they differ beyond the dtype's
    tolerance, 0 otherwise)."""
    ok, worst, detail = _compare(actual, expected, None, None)
    print("max |region - reference| =", worst, detail)
    return 0 if ok else 1


def _clone(tree):
    def copy(leaf):
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().clone().requires_grad_(leaf.requires_grad)
        return leaf

    return pytree.tree_map(copy, tree)


def _stage_output(trace: Trace, value):
    return value[0] if trace.name == "forward" else value


def _narrow(good: Trace, bad: Trace, inputs_for, rtol, atol) -> BoundSymbol | None:
    """The first statement of `bad` whose outputs differ from `good`'s values of the same names
    (or, for a statement without counterparts, from its own subsymbols run by torch)."""
    _, good_env = interpret(good, *inputs_for(good))
    _, bad_env = interpret(bad, *inputs_for(bad))
    for bsym in bad.bsyms:
        if bsym.is_del:
            continue
        outputs = list(iter_proxies(bsym.output))
        known = [p for p in outputs if p.name in good_env]
        if known:
            ok, _, _ = _compare([bad_env[p.name] for p in known],
                                [good_env[p.name] for p in known], rtol, atol)
            if not ok:
                return bsym
        elif bsym.subsymbols:
            region = Trace("region", tuple(bsym.proxy_inputs), bsym.subsymbols, bsym.output)
            reference, _ = interpret(region, *[bad_env[p.name] for p in bsym.proxy_inputs])
            actual = [bad_env[p.name] for p in outputs]
            if not _compare(actual, pytree.tree_leaves(reference), rtol, atol)[0]:
                return bsym
    return None


def _counterpart(good: Trace, bsym: BoundSymbol) -> BoundSymbol | None:
    names = bsym.output_names
    return next((b for b in good.bsyms if b.output_names & names), None)


def _is_fusion(bsym: BoundSymbol) -> bool:
    return "fusion" in bsym.sym.tags and bsym.sym.executor is not None and bool(bsym.subsymbols)


def _write_repro(culprit: BoundSymbol, reference: BoundSymbol | None, directory: str) -> str:
    """A script that runs the culprit and its reference on random inputs of the same metadata
    and exits 1 when they disagree; it needs no state of this process (fusions are rebuilt).
    A fusion's reference is its own region, run by torch."""
    inputs = culprit.proxy_inputs
    parts = []
    statement = portable_statement(culprit)
    reference = portable_statement(reference) if reference is not None else None
    reference_call = None
    if _is_fusion(culprit):
        preamble, statement = fusion_preamble(culprit)
        parts.append(preamble)
        reference_call = f"{culprit.sym.name}_region"
        reference_inputs = inputs
    region = Trace("region", tuple(inputs), (statement,), culprit.output)
    parts.insert(0, print_trace(region)[0])
    if reference_call is None and reference is not None:
        if _is_fusion(reference):
            preamble, reference = fusion_preamble(reference)
            parts.append(preamble)
        ref_trace = Trace("reference", tuple(reference.proxy_inputs), (reference,),
                          reference.output)
        parts.append(print_trace(ref_trace)[0])
        reference_call = "reference"
        reference_inputs = reference.proxy_inputs
    makers = []
    for proxy in inputs:
        dtype = str(proxy.dtype)
        if proxy.dtype.is_floating_point or proxy.dtype.is_complex:
            makers.append(f"torch.randn({tuple(proxy.shape)}, dtype={dtype})")
        elif proxy.dtype == torch.bool:
            makers.append(f"torch.rand({tuple(proxy.shape)}) > 0.5")
        else:
            makers.append(f"torch.randint(0, 8, {tuple(proxy.shape)}, dtype={dtype})")
    by_name = ", ".join(f"{p.name!r}: {m}" for p, m in zip(inputs, makers))
    ref_args = ", ".join(f"values[{p.name!r}]" for p in (reference_inputs if reference_call
                                                         else ()))
    main = f'''

if __name__ == "__main__":
    import sys

    from fulmen.tools.verify import check_repro

    torch.manual_seed(0)
    values = {{{by_name}}}
    actual = region(*values.values())
    expected = {f"{reference_call}({ref_args})" if reference_call else "None"}
    if expected is None:
        print("no reference statement; actual:", actual)
        sys.exit(0)
    sys.exit(check_repro(actual, expected))
'''
    # the printed traces each carry their own header and imports; keep them as one module
    source = "\n\n".join(parts) + main
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"fulmen_repro_{culprit.sym.name}.py")
    with open(path, "w") as handle:
        handle.write(source)
    return path


def _float64_run(fn, args, kwargs):
    """`(inputs requiring grad, outputs)` of `fn` run on float64 copies of its floating inputs,
    or None when there are none below float64 or `fn` does not compute in float64 then (it
    holds lower-precision tensors of its own, or fails)."""
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.is_floating_point() and t.dtype != torch.float64 for t in leaves):
        return None

    def widen(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.detach().double().requires_grad_(leaf.requires_grad)
        return leaf

    wide_args, wide_kwargs = pytree.tree_map(widen, (args, kwargs))
    try:
        outputs = fn(*wide_args, **wide_kwargs)
    except Exception:
        return None
    if not all(o.dtype == torch.float64 for o in pytree.tree_leaves(outputs)
               if isinstance(o, torch.Tensor) and o.is_floating_point()):
        return None
    grad_inputs = [t for t in pytree.tree_leaves((wide_args, wide_kwargs))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
    return grad_inputs, outputs


def verify(fn, *args, executors=None, rtol: float | None = None, atol: float | None = None,
           repro_dir: str | None = None, minimize: bool = False, against=None,
           **kwargs) -> VerifyReport:
    """Compile `fn` and check every stage against eager on `(args, kwargs)`.

    Returns a `VerifyReport` (never raises for a mismatch). Inputs are cloned, so `fn` sees
    fresh copies in each run. `repro_dir` defaults to a new temporary directory.

    `minimize=True` also compares the whole compiled program with eager (or, given `against`,
    with the program compiled for the executors `against`: a cross-executor check) by the
    float64 rule, and when it fails shrinks the traced program statement by statement while
    the failure keeps its kind (`fulmen.minimize`), writes it as a standalone script
    (`minimized_path`) and verifies the minimized program stage by stage
    (`minimized_report`: the pass and the statement).

    Example:
        >>> report = fulmen.verify(f, x, y, executors=[myex, "torch"])
        >>> print(report)
    """
    report = VerifyReport()
    eager_args, eager_kwargs = _clone((args, kwargs))
    expected = fn(*eager_args, **eager_kwargs)
    grad_inputs = [t for t in pytree.tree_leaves((eager_args, eager_kwargs))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
    wants_grad = torch.is_grad_enabled() and bool(grad_inputs)
    with torch.random.fork_rng(devices=[]):  # the compiled run draws what eager drew
        wide = _float64_run(fn, *_clone((args, kwargs)))
    reference = _detached(wide[1]) if wide is not None else None

    jit_args, jit_kwargs = _clone((args, kwargs))
    jfn = jit(fn, executors=executors)
    compiled = jfn(*jit_args, **jit_kwargs)
    machinery = _jitted(jfn)
    entry = list(machinery._cache.values())[-1]
    leaves = pytree.tree_leaves((jit_args, jit_kwargs))
    state = [slot.get() for slot in machinery._state_slots]
    inputs = [leaves[i] for i in entry.tensor_positions] + state + list(entry.captured)
    traces = list(entry.traces)
    if entry.tree:  # a program with graph breaks: its segments hold the captured tensors
        values = dict(zip(entry.fn.arg_names, inputs)) | _tree_constants(entry.fn.root)
        inputs = [values[name] for name in traces[0].arg_names]

    previous = None
    with torch.no_grad():
        for trace in traces:
            value, _ = interpret(trace, *inputs)
            ok, worst, detail = _compare(_stage_output(trace, value), expected, rtol, atol,
                                         reference=reference)
            report.stages.append(StageCheck(trace.provenance, ok, worst, detail))
            if not ok and report.first_bad_stage is None:
                report.first_bad_stage = trace.provenance
                _locate(report, previous, trace, lambda _: inputs, rtol, atol, repro_dir)
            previous = trace

    if entry.tree:
        _verify_tree(report, compiled, expected, leaves, grad_inputs if wants_grad else [],
                     rtol, atol, reference, wide)
    elif wants_grad:
        _verify_backward(report, machinery, traces, inputs, expected, grad_inputs,
                         rtol, atol, repro_dir, wide)
    if minimize and not kwargs:
        _minimize(report, fn, args, executors, against, repro_dir)
    return report


def _tree_constants(node) -> dict[str, torch.Tensor]:
    """The captured tensors (closures, globals) of every segment of a trace tree, by name."""
    if node is None:
        return {}
    constants = dict(node.constants)
    for child in node.children.values():
        constants |= _tree_constants(child)
    return constants


def _minimize(report, fn, args, executors, against, repro_dir) -> None:
    """Shrink a failing program and verify the small one (see `verify`)."""
    small = minimize_program(fn, *_clone(args), executors=executors, against=against)
    if small is None:
        return
    directory = repro_dir or tempfile.mkdtemp(prefix="fulmen_verify_")
    report.minimized_failure = str(small.failure)
    report.minimized_path = write_script(small, os.path.join(directory, "fulmen_minimized.py"))
    if report.first_bad_stage is None:
        report.first_bad_stage = f"whole program ({small.failure.kind})"
    try:
        report.minimized_report = verify(small.trace.python_callable(), *small.inputs,
                                         executors=executors, repro_dir=directory)
    except Exception:  # noqa: BLE001 - e.g. the failure is an error of the compiled run
        report.minimized_report = None


def _detached(tree):
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _locate(report, good, bad, inputs_for, rtol, atol, repro_dir) -> None:
    """Narrow a divergence of stage `bad` (vs the stage `good` before it) to one statement;
    `inputs_for(trace)` gives a stage's arguments."""
    if good is None:
        return
    culprit = _narrow(good, bad, inputs_for, rtol, atol)
    if culprit is None:
        return
    report.culprit = statement_source(culprit)
    report.culprit_op = culprit.sym.name
    reference = _counterpart(good, culprit)
    if reference is not None:
        report.culprit_op = f"{culprit.sym.name} (replacing {reference.sym.python_name})"
    directory = repro_dir or tempfile.mkdtemp(prefix="fulmen_verify_")
    report.repro_path = _write_repro(culprit, reference, directory)


def _verify_backward(report, machinery, forwards: list[Trace], inputs, expected, grad_inputs,
                     rtol, atol, repro_dir, wide=None) -> None:
    """Run every backward stage on the forward's residuals; compare input gradients. Residuals
    are taken by name from the values of every forward stage (an early backward stage may read
    a value that a later forward stage computes inside a fusion)."""
    backward_traces = machinery._stats.last_backward_traces
    if not backward_traces:
        return
    cotangents, eager_grads = _input_grads(expected, grad_inputs)
    reference = _float64_grads(wide, cotangents, grad_inputs)
    with torch.no_grad():
        forward_env = {}
        for forward in forwards:
            forward_env.update(interpret(forward, *inputs)[1])

        def backward_inputs(trace: Trace) -> list:
            residuals = [forward_env[n] for n in trace.arg_names if n in forward_env]
            return residuals + cotangents

        previous = None
        for trace in backward_traces:
            # stages may differ in which forward values they take (rematerialization): feed each
            # its arguments by name from the forward's values, then the cotangents in order
            grads, _ = interpret(trace, *backward_inputs(trace))
            actual = [g for g, x in zip(grads, inputs)
                      if isinstance(x, torch.Tensor) and x.requires_grad]
            actual = [torch.zeros_like(x) if g is None else g for g, x in zip(actual, grad_inputs)]
            ok, worst, detail = _compare(actual, eager_grads, rtol, atol, scale=10.0,
                                         reference=reference)
            stage = f"backward: {trace.provenance}"
            report.stages.append(StageCheck(stage, ok, worst, detail))
            if not ok and report.first_bad_stage is None:
                report.first_bad_stage = stage
                _locate(report, previous, trace, backward_inputs, rtol, atol, repro_dir)
            previous = trace


def _input_grads(outputs, grad_inputs) -> tuple[list, list]:
    """Seeded random cotangents for the outputs that require grad, and the gradients of
    `grad_inputs` they give (zeros where unused)."""
    generator = torch.Generator().manual_seed(0)
    out_leaves = [o for o in pytree.tree_leaves(outputs)
                  if isinstance(o, torch.Tensor) and o.requires_grad]
    cotangents = [torch.randn(o.shape, generator=generator, dtype=o.dtype) for o in out_leaves]
    grads = torch.autograd.grad(out_leaves, grad_inputs, cotangents, allow_unused=True)
    return cotangents, [torch.zeros_like(x) if g is None else g
                        for g, x in zip(grads, grad_inputs)]


def _verify_tree(report, compiled, expected, jit_leaves, grad_inputs, rtol, atol,
                 reference, wide) -> None:
    """A program with graph breaks: its compiled segments (each with its own backward) are no
    stage of the traced program, so check the compiled call's outputs and input gradients."""
    stages = [("compiled segments (graph breaks)", _detached(compiled), expected, reference,
               1.0)]
    if grad_inputs:
        cotangents, eager_grads = _input_grads(expected, grad_inputs)
        _, grads = _input_grads(compiled, [t for t in jit_leaves if isinstance(t, torch.Tensor)
                                           and t.requires_grad])
        stages.append(("backward: compiled segments (graph breaks)", grads, eager_grads,
                       _float64_grads(wide, cotangents, grad_inputs), 10.0))
    for stage, actual, wanted, wide_reference, scale in stages:
        ok, worst, detail = _compare(actual, wanted, rtol, atol, scale=scale,
                                     reference=wide_reference)
        report.stages.append(StageCheck(stage, ok, worst, detail))
        if not ok and report.first_bad_stage is None:
            report.first_bad_stage = stage


def _float64_grads(wide, cotangents, grad_inputs) -> list | None:
    """The float64 run's input gradients for the same cotangents (zeros where unused), or
    None without a float64 run that matches the inputs requiring grad."""
    if wide is None:
        return None
    wide_inputs, outputs = wide
    out_leaves = [o for o in pytree.tree_leaves(outputs)
                  if isinstance(o, torch.Tensor) and o.requires_grad]
    if len(wide_inputs) != len(grad_inputs) or len(out_leaves) != len(cotangents):
        return None
    grads = torch.autograd.grad(out_leaves, wide_inputs, [c.double() for c in cotangents],
                                allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, wide_inputs)]


__all__ = ["StageCheck", "VerifyReport", "check_repro", "verify"]
