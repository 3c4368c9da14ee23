"""Checking a model case against eager: `check_case` runs it eagerly, through `fulmen.jit`
and (when values differ beyond a tight tolerance) in float64, and raises `Mismatch` unless
fulmen's error vs float64 is within the float64 rule (`fulmen.accuracy.check_accuracy`, with
eager's mean error over the record's group as the noise level); `minimize` reduces a failing
case and `repro` writes it as a standalone script."""

import torch

from fulmen.accuracy import check_accuracy, rms, tight
from tests.fuzz.model_cases import run_sequence, smaller
from tests.fuzz.models import Case, build

# ---------------------------------------------------------------------------------------------
# checking a case against eager


class Mismatch(AssertionError):
    """fulmen and eager disagree; `kind` groups failures for the minimizer ("value: grad",
    "error: RuntimeError", ...)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class InvalidCase(Exception):
    """Eager itself fails on the case: a bug of the generator, not of fulmen."""


def _group_noise(expected, reference, what) -> float:
    """Eager's mean rms error vs float64 over the records of `what`'s call and kind."""
    group = what.split()[:3]
    errors = [rms(e.double() - r.double()) for (w, e), (_, r) in zip(expected, reference)
              if w.split()[:3] == group and e is not None and r is not None
              and e.is_floating_point() and e.shape == r.shape and torch.isfinite(r).all()]
    return sum(errors) / len(errors) if errors else 0.0


def run_eager(case: Case) -> list:
    model = build(case)
    return run_sequence(case, model, model)


def run_fulmen(case: Case, executors) -> list:
    import fulmen

    model = build(case)
    jitted = fulmen.jit(model, executors=executors)
    return run_sequence(case, model, jitted)


def run_reference(case: Case) -> list:
    model = build(case, torch.float64)
    return run_sequence(case, model, model, reference=True)


def check_case(case: Case, executors=("torch",)) -> None:
    """Run `case` eagerly and through fulmen.jit; raise `Mismatch` where outputs, buffers or
    gradients disagree beyond the tight tolerance and the float64 rule."""
    try:
        expected = run_eager(case)
    except Exception as error:  # noqa: BLE001
        raise InvalidCase(f"eager fails: {type(error).__name__}: {error}") from error
    try:
        actual = run_fulmen(case, list(executors))
    except Exception as error:  # noqa: BLE001 - any error of fulmen's is a finding
        raise Mismatch(f"error: {type(error).__name__}", str(error)[:2000]) from error
    if [w for w, _ in actual] != [w for w, _ in expected]:
        raise Mismatch("structure", f"{[w for w, _ in actual]} vs {[w for w, _ in expected]}")
    reference = None
    low_precision = case.context.autocast or case.context.bf16_weights or any(
        call.change == "autocast" for call in case.calls) or any(
        getattr(b, "autocast_inside", False) for b in getattr(case.model, "blocks", ()))
    for index, ((what, e), (_, a)) in enumerate(zip(expected, actual)):
        kind = what.split()[2]
        if e is None or a is None:
            if (e is None) != (a is None) and not (
                    (a if e is None else e).count_nonzero() == 0):
                raise Mismatch("missing grad", f"{what}: eager {e is None and 'None'}, "
                                               f"fulmen {a is None and 'None'}")
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            raise Mismatch(f"metadata: {kind}", f"{what}: {a.dtype}{list(a.shape)} vs "
                                                 f"{e.dtype}{list(e.shape)}")
        if tight(a, e):
            continue
        if not e.is_floating_point():
            raise Mismatch(f"value: {kind}", f"{what}: {a.tolist()} vs {e.tolist()}")
        if reference is None:
            reference = run_reference(case)
        result = check_accuracy(a, e, reference[index][1], low_precision or None,
                                _group_noise(expected, reference, what))
        if not result.ok:
            raise Mismatch(f"value: {kind}", f"{what}: max |fulmen - eager| "
                                             f"{float((a.double() - e.double()).abs().max()):.3g}; "
                                             f"{result.detail}")


def failure_of(case: Case, executors) -> Mismatch | None:
    try:
        check_case(case, executors)
    except Mismatch as mismatch:
        return mismatch
    return None


def minimize(case: Case, executors, kind: str, attempts: int = 80) -> Case:
    """Greedily apply `smaller` while the failure keeps its kind (at most `attempts` runs)."""
    progress = True
    while progress and attempts > 0:
        progress = False
        for candidate in smaller(case):
            attempts -= 1
            try:
                failure = failure_of(candidate, executors)
            except InvalidCase:  # the simplification made a case eager rejects
                continue
            if failure is not None and failure.kind == kind:
                case, progress = candidate, True
                break
            if attempts <= 0:
                break
    return case


def repro(case: Case, executors) -> str:
    """A standalone script reproducing `case`'s failure (run from the repository root)."""
    policy = ""
    if "codegen" in executors:
        policy = ("from fulmen.executors.codegen import set_compile_policy\n"
                  "set_compile_policy('eager')\n")
    return ("import torch\n" + policy + "from tests.fuzz.models import *  # noqa\n"
            "from tests.fuzz.model_check import check_case\n\n"
            f"case = {case!r}\ncheck_case(case, {list(executors)!r})\n")
