"""Checking a model case against eager: `check_case` runs it eagerly, through `fulmen.jit`
and (when values differ beyond a tight tolerance) in float64, and raises `Mismatch` unless
fulmen's error vs float64 is within the float64 rule (`fulmen.tools.accuracy.check_accuracy`, with
eager's mean error over the record's group as the noise level); `minimize` reduces a failing
case and `repro` writes it as a standalone script."""

import functools

import torch

from fulmen.tools.accuracy import check_accuracy, rms, tight
from tests.fuzz.model_cases import run_sequence, smaller
from tests.fuzz.models import Case, Memory, build

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


# executor lists each case runs under: torch alone; decomposed to prims first; codegen kernels;
# symbolic sizes from the first call (`dynamic=True`: later calls at other batch sizes and
# lengths reuse the symbolic trace where its guards hold)
CONFIGS = {"torch": {"executors": ["torch"]},
           "decomposed": {"executors": ["torch"], "transforms": "decompose_to_prims"},
           "codegen": {"executors": ["codegen", "torch"]},
           "dynamic": {"executors": ["torch"], "dynamic": True}}
MIN_CALLS = {"dynamic": 2}  # calls per generated case (`cases(min_calls=)`), where not 1


def _config(config) -> dict:
    """A name of `CONFIGS`, or an executor list."""
    if isinstance(config, str):
        config = dict(CONFIGS[config])
    else:
        config = {"executors": list(config)}
    if config.get("transforms") == "decompose_to_prims":
        from fulmen.transforms import decompose_to_prims

        config["transforms"] = [decompose_to_prims]
    return config


def _process_group():
    """A single-process gloo group (in-process store) for the DDP contexts; made once."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def _ddp(module):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, process_group=_process_group(),
                                   find_unused_parameters=True)


def run_eager(case: Case) -> list:
    model = build(case)
    return run_sequence(case, model, _ddp(model) if case.context.ddp else model)


def _refusals(case: Case) -> str | None:
    """The documented refusal the case may meet (a message fragment), if any: a buffer
    replaced by the forward (`Memory`) is replayed, but not in a program with graph breaks."""
    blocks = getattr(case.model, "blocks", ()) + getattr(case.model, "extra", ())
    if any(isinstance(b, Memory) for b in blocks):
        return "and has graph breaks"
    return None


def run_fulmen(case: Case, config) -> list:
    import fulmen

    options = _config(config)
    model = build(case)
    if case.context.ddp:  # both spellings: DDP's forward runs eagerly around the compiled model
        fn = fulmen.jit(_ddp(model), **options) if case.seed % 2 else \
            _ddp(fulmen.jit(model, **options))
    elif case.context.call == "argument":  # the model reaches the jitted function as an argument
        fn = functools.partial(fulmen.jit(model_as_argument, **options), model)
    else:
        fn = fulmen.jit(model, **options)
    return run_sequence(case, model, fn,
                        compile_step=lambda step: fulmen.jit(step, **options))


def model_as_argument(model, *inputs):
    """The function of the `call="argument"` context: `fulmen.jit(model_as_argument)(model,
    *inputs)`, a training step's loss function that takes the model as an argument."""
    return model(*inputs)


def run_reference(case: Case) -> list:
    model = build(case, torch.float64)
    return run_sequence(case, model, _ddp(model) if case.context.ddp else model,
                        reference=True)


def check_case(case: Case, executors="torch") -> None:
    """Run `case` eagerly and through fulmen.jit (`executors`: a name of `CONFIGS` or an
    executor list); raise `Mismatch` where outputs, buffers, KV caches, gradients or optimizer
    updates disagree beyond the tight tolerance and the float64 rule, or where fulmen raises
    anything but a refusal it documents."""
    try:
        expected = run_eager(case)
    except Exception as error:  # noqa: BLE001
        raise InvalidCase(f"eager fails: {type(error).__name__}: {error}") from error
    refusal = _refusals(case)
    try:
        actual = run_fulmen(case, executors)
    except Mismatch:
        raise
    except Exception as error:  # noqa: BLE001 - any error of fulmen's is a finding
        if refusal is not None and refusal in str(error):
            return
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
    if "codegen" in _config(executors)["executors"]:
        policy = ("from fulmen.executors.codegen import set_compile_policy\n"
                  "set_compile_policy('eager')\n")
    return ("import torch\n" + policy + "from tests.fuzz.models import *  # noqa\n"
            "from tests.fuzz.model_check import check_case\n\n"
            f"case = {case!r}\ncheck_case(case, {executors!r})\n")


def trace_repro(case: Case, executors, directory: str):
    """Statement deletion on the trace (`fulmen.minimize`): the first call of `case` as one
    traced program with its inputs (parameters and buffers included), shrunk while it fails
    the same way by itself, written as a standalone script in `directory`. Returns
    `(Minimized, path)`, or None when the failure needs the call sequence (state changes,
    graph breaks) and the first call alone does not show it."""
    import contextlib

    import fulmen
    from fulmen.tools.minimize import failure_of as program_failure
    from fulmen.tools.minimize import program_of, shrink, write_script
    from tests.fuzz.model_cases import make_inputs

    options = _config(executors)
    model = build(case)
    ctx = case.context
    dtype = ctx.half if ctx.bf16_weights else torch.float32
    inputs = [t for t in make_inputs(case, 0, dtype) if t is not None]
    grad = torch.enable_grad() if ctx.grad else torch.no_grad()
    autocast = (torch.autocast("cpu", dtype=ctx.half) if ctx.autocast
                else contextlib.nullcontext())
    with grad, autocast:
        try:
            program = program_of(fulmen.jit(model, **options), *inputs)
        except Exception:  # noqa: BLE001 - the failure is an error while compiling
            return None
        if program is None:
            return None
        trace, values = program
        options = {"executors": options["executors"], "transforms": options.get("transforms")}
        try:
            failure = program_failure(trace.python_callable(), values, **options)
        except Exception:  # noqa: BLE001
            return None
        if failure is None:
            return None
        small = shrink(trace, values, failure, options, max_runs=120)
    return small, write_script(small, f"{directory}/fulmen_minimized_case.py")
