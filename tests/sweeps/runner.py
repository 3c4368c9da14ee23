"""The driver shared by the sweeps: run one child process per case with a timeout, `--jobs` at
a time, and print a results table (one line per case, in the order given, as each finishes).

A child is `python -m <module> --one CASE [extra args]`; it prints one line starting with
`RESULT ` followed by JSON: `status` (OK / WRONG / ERROR / SKIP), `detail`, `compiles`,
`eager_calls`. A child that dies or runs past the timeout is an ERROR with its last stderr line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

STATUSES = ("OK", "WRONG", "ERROR", "SKIP")


def result_line(status: str, detail: str = "", **counts) -> str:
    """The line a child prints for the driver."""
    return "RESULT " + json.dumps(dict(status=status, detail=detail, **counts))


def _run_child(module: str, case: str, extra: list[str], timeout: float) -> dict:
    start = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        proc = subprocess.run([sys.executable, "-m", module, "--one", case, *extra],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(status="ERROR", detail=f"timeout after {timeout:.0f} s",
                    seconds=time.perf_counter() - start)
    seconds = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]), seconds=seconds)
    tail = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or ["no output"]
    return dict(status="ERROR", detail=f"child exited {proc.returncode}: {tail[0][:200]}",
                seconds=seconds)


def format_row(case: str, result: dict) -> str:
    """One table line: case, status (with the reason), compiles, eager calls, seconds."""
    status = result["status"]
    detail = " ".join(str(result.get("detail", "")).split())[:300]
    label = f"{status}({detail})" if detail and status != "OK" else status
    if status == "OK" and detail:
        label = f"OK [{detail}]"
    return (f"| {case} | {label} | {result.get('compiles', '-')} | "
            f"{result.get('eager_calls', '-')} | {result.get('seconds', 0):.0f} |")


def run_cases(module: str, cases: list[str], extra: list[str], jobs: int, timeout: float,
              out_path: str | None = None) -> dict[str, dict]:
    """Run every case in its own child (`jobs` at a time); print and return the results."""
    header = "| case | result | compiles | eager calls | seconds |\n| --- | --- | --- | --- | --- |"
    print(header, flush=True)
    results: dict[str, dict] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {case: pool.submit(_run_child, module, case, extra, timeout) for case in cases}
        for case in cases:
            results[case] = futures[case].result()
            print(format_row(case, results[case]), flush=True)
    counts = {status: sum(r["status"] == status for r in results.values()) for status in STATUSES}
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    print(f"\n{len(cases)} cases: {summary}", flush=True)
    if out_path:
        with open(out_path, "w") as f:
            f.write(header + "\n")
            f.writelines(format_row(case, results[case]) + "\n" for case in cases)
            f.write(f"\n{len(cases)} cases: {summary}\n")
    return results
