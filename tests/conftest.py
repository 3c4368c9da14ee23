import os

import pytest
import torch

os.environ.setdefault("FULMEN_CHECK", "1")


def pytest_addoption(parser):
    parser.addoption("--opinfo-samples", default="8",
                     help="samples per OpInfo in conformance tests: a number or 'all'")


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


@pytest.fixture
def codegen_eager():
    """Codegen compiles every kernel when its region is fused and calls wait for it, so a test
    checks the generated kernels rather than the torch fallback of a region not yet hot."""
    from fulmen.executors.codegen import set_compile_policy

    previous = set_compile_policy("eager")
    yield
    set_compile_policy(previous.mode, previous.hot_calls)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
