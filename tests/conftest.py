import importlib.metadata
import os

import pytest
import torch

from tests.environment import apply_test_environment

apply_test_environment()  # FULMEN_CHECK=1, FULMEN_FUSE_TINY=1 (tests/environment.py)


def pytest_addoption(parser):
    parser.addoption("--opinfo-samples", default="8",
                     help="samples per OpInfo in conformance tests: a number or 'all'")


def _versions() -> str:
    """The versions a run used: real-model results depend on transformers and litgpt."""
    found = []
    for name in ("torch", "transformers", "litgpt"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} absent")
    return ", ".join(found)


def pytest_report_header(config):
    return _versions()


def pytest_sessionstart(session):
    # -q hides the report header (make test runs quietly): print the versions anyway.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not reporter.showheader:
        reporter.write_line(_versions())


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory):
    """Compiled kernels go to a per-session directory, never to the user's ~/.cache."""
    old = os.environ.get("FULMEN_CACHE_DIR")
    os.environ["FULMEN_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "fulmen-cache")
    yield
    if old is None:
        os.environ.pop("FULMEN_CACHE_DIR", None)
    else:
        os.environ["FULMEN_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _seeded_generators():
    """Each test starts from the same state of torch's and Python's generators, so the inputs
    it draws do not depend on which tests ran before it in its worker (`make test` spreads
    files over workers by timing)."""
    import random

    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture
def codegen_eager():
    """Codegen compiles every kernel when its region is fused and calls wait for it, so a test
    checks the generated kernels rather than the torch fallback of a region not yet hot."""
    from fulmen.executors.codegen import set_compile_policy

    previous = set_compile_policy("eager")
    yield
    set_compile_policy(previous.mode, previous.hot_calls)

