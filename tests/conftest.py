import os

import pytest
import torch

os.environ.setdefault("FULMEN_CHECK", "1")


def pytest_addoption(parser):
    parser.addoption("--opinfo-samples", default="8",
                     help="samples per OpInfo in conformance tests: a number or 'all'")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
