"""Run every entry of PyTorch's `op_db` through `fulmen.jit` and compare with eager.

    .venv/bin/python -m tests.conformance.run_conformance [--samples 3] [--only NAME ...]
        [--no-grad] [--output tests/conformance/RESULTS.md]

Per OpInfo (float32, CPU, up to `--samples` samples) the forward status is one of

- pass: every usable sample matches eager (values, shapes, dtypes);
- mismatch: some sample gives a different result (a bug; the suite requires zero);
- error: fulmen raises on a sample eager runs (e.g. a value-dependent output shape);
- skip: no usable sample (no float32 support, or eager rejects every sample).

For entries that pass forward and support autograd, gradients of `sum(out * cotangent)` are
compared the same way (`tests/ops/opinfo_harness.py`). The table goes to a markdown file; the
exit status is 1 when there is any mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.ops.opinfo_harness import (
    EagerError,
    assert_same,
    assert_same_grads,
    run_grad_sample,
    run_sample,
)

# Entries whose eager results are not reproducible run to run, so no comparison is meaningful;
# they are reported as `excluded` with the reason (never counted as a pass).
EXCLUDED: dict[str, str] = {}

# Values of these ops are uninitialised memory: only shapes and dtypes are compared. Random ops
# are compared exactly: eager and the jitted call each start from the same seed.
UNINITIALISED = {
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
}  # fmt: skip

DEFAULT_OUTPUT = Path(__file__).with_name("RESULTS.md")


def _call_unseeded(op, *args, **kwargs):
    return op(*args, **kwargs)


def seed_outside_ops() -> None:
    """Make op_db's random entries draw from the generator as seeded by the caller.

    op_db wraps random ops in `wrapper_set_seed`, which seeds torch inside the op. Called inside
    a traced function, that seeding happens once, at trace time, not at run time, so the wrapped
    op cannot be compared. The harness seeds before the eager and before the jitted call instead.
    """
    from torch.testing._internal import common_methods_invocations

    common_methods_invocations.wrapper_set_seed = _call_unseeded


@dataclass
class Row:
    """The outcome of one OpInfo."""

    name: str
    forward: str = "skip"
    backward: str = "-"
    samples: int = 0
    note: str = ""
    grad_note: str = ""
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)


def opinfo_name(info) -> str:
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int):
    """Raise `_Timeout` in the main thread after `seconds` (SIGALRM; POSIX only)."""

    def on_alarm(signum, frame):
        raise _Timeout(f"took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    message = text[0] if text else ""
    return f"{type(error).__name__}: {message}"[:160]


def _eager_runs(info, sample) -> bool:
    try:
        with torch.no_grad():
            torch.manual_seed(0)
            info.op(sample.input, *sample.args, **sample.kwargs)
        return True
    except Exception:
        return False


def forward_samples(info, limit: int):
    """Up to `limit` float32 CPU samples eager accepts (an empty list: no usable sample)."""
    if torch.float32 not in info.supported_dtypes("cpu"):
        return [], "no float32 support"
    usable, seen = [], 0
    try:
        for sample in info.sample_inputs("cpu", torch.float32, requires_grad=False):
            seen += 1
            if _eager_runs(info, sample):
                usable.append(sample)
            if len(usable) >= limit or seen >= 4 * limit:
                break
    except Exception as error:  # sample generation itself fails on this build
        if not usable:
            return [], f"sample generation fails: {_first_line(error)}"
    if not usable:
        return [], "no sample" if seen == 0 else "eager rejects every sample"
    return usable, ""


def check_forward(info, samples) -> tuple[str, str]:
    """(status, note) of the forward comparison over `samples`."""
    errors = []
    for sample in samples:
        try:
            expected, actual, _ = run_sample(info, sample, "whole", seed=0)
        except _Timeout:
            raise
        except Exception as error:
            errors.append(_first_line(error))
            continue
        try:
            assert_same(expected, actual, info, unspecified=UNINITIALISED)
        except AssertionError as error:
            return "mismatch", _first_line(error)
    if errors:
        return "error", errors[0]
    return "pass", ""


def check_backward(info, limit: int) -> tuple[str, str]:
    """(status, note) of the gradient comparison over up to `limit` samples."""
    ran, errors = 0, []
    try:
        samples = []
        for sample in info.sample_inputs("cpu", torch.float32, requires_grad=True):
            samples.append(sample)
            if len(samples) >= limit:
                break
    except Exception as error:
        return "skip", f"grad sample generation fails: {_first_line(error)}"
    for sample in samples:
        try:
            torch.manual_seed(0)
            result = run_grad_sample(info, sample, seed=0)
        except _Timeout:
            raise
        except EagerError:
            continue
        except Exception as error:
            errors.append(_first_line(error))
            continue
        if result is None:
            continue
        try:
            assert_same_grads(*result, info)
        except AssertionError as error:
            return "mismatch", _first_line(error)
        ran += 1
    if errors:
        return "error", errors[0]
    if ran == 0:
        return "skip", "no differentiable output"
    return "pass", ""


def run_one(info, limit: int, grads: bool, seconds: int = 120) -> Row:
    row = Row(opinfo_name(info))
    start = time.perf_counter()
    if row.name in EXCLUDED:
        row.forward, row.note = "excluded", EXCLUDED[row.name]
        return row
    try:
        with time_limit(seconds):
            samples, why = forward_samples(info, limit)
            row.samples = len(samples)
            if not samples:
                row.forward, row.note = "skip", why
            else:
                row.forward, row.note = check_forward(info, samples)
            if grads and row.forward == "pass" and info.supports_autograd:
                row.backward, row.grad_note = check_backward(info, limit)
    except _Timeout as error:
        if row.forward == "pass":
            row.backward, row.grad_note = "error", f"timeout: {error}"
        else:
            row.forward, row.note = "error", f"timeout: {error}"
    row.seconds = time.perf_counter() - start
    return row


def summarize(rows: list[Row]) -> dict[str, Counter]:
    return {
        "forward": Counter(row.forward for row in rows),
        "backward": Counter(row.backward for row in rows if row.backward != "-"),
    }


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def render(rows: list[Row], command: str, seconds: float) -> str:
    counts = summarize(rows)
    fwd, bwd = counts["forward"], counts["backward"]
    usable = fwd["pass"] + fwd["mismatch"] + fwd["error"]
    grad_usable = bwd["pass"] + bwd["mismatch"] + bwd["error"]
    lines = [
        "# OpInfo conformance (float32, CPU)",
        "",
        f"Produced by `{command}` in {seconds:.0f} s (torch {torch.__version__}).",
        "Every `op_db` entry runs through `fulmen.jit` with the default executors (codegen",
        "kernels compiled before the first call, then torch) and is compared with eager. A",
        "usable entry has at least one float32 CPU sample eager accepts.",
        "",
        "| | pass | mismatch | error | skip | excluded | pass rate |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| forward | {fwd['pass']} | {fwd['mismatch']} | {fwd['error']} | {fwd['skip']} | "
        f"{fwd['excluded']} | {_percent(fwd['pass'], usable)} of {usable} usable |",
        f"| backward | {bwd['pass']} | {bwd['mismatch']} | {bwd['error']} | {bwd['skip']} | - | "
        f"{_percent(bwd['pass'], grad_usable)} of {grad_usable} usable |",
        "",
        "Backward runs for entries that pass forward and support autograd; `skip` there means",
        "no sample has a differentiable output.",
        "",
        "| op | forward | backward | samples | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in sorted(rows, key=lambda r: r.name):
        note = row.note or row.grad_note
        note = note.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {row.name} | {row.forward} | {row.backward} | {row.samples} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="run only these OpInfo names")
    parser.add_argument("--no-grad", action="store_true", help="skip the gradient comparison")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    from torch.testing._internal.common_methods_invocations import op_db

    from fulmen.executors.codegen import set_compile_policy

    set_compile_policy("eager")  # run the generated kernels, not a cold region's torch fallback
    warnings.filterwarnings("ignore")
    seed_outside_ops()
    start = time.perf_counter()
    rows = []
    for info in op_db:
        name = opinfo_name(info)
        if args.only and name not in args.only and info.name not in args.only:
            continue
        row = run_one(info, args.samples, grads=not args.no_grad)
        rows.append(row)
        if not args.quiet or row.forward == "mismatch" or row.backward == "mismatch":
            note = row.note or row.grad_note
            print(f"{row.name:45s} {row.forward:9s} {row.backward:9s} {row.seconds:6.2f}s  {note}",
                  flush=True)
    seconds = time.perf_counter() - start
    command = "python -m tests.conformance.run_conformance " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if not args.only:
        args.output.write_text(render(rows, command.strip(), seconds))
    counts = summarize(rows)
    print({key: dict(value) for key, value in counts.items()}, f"{seconds:.0f} s")
    mismatches = counts["forward"]["mismatch"] + counts["backward"]["mismatch"]
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
