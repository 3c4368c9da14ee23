"""Tests' helper: run a snippet in a fresh Python process and report what it imported.

For properties no test inside the pytest process can observe, because something already
imported the module in question (`torch._dynamo`, which costs about a second to import).
"""

from __future__ import annotations

import subprocess
import sys


def imports_module(code: str, module: str = "torch._dynamo") -> bool:
    """Whether `module` is in `sys.modules` after a fresh interpreter runs `code` (from the
    current directory, so the checkout's `fulmen` is the one imported); raises
    `subprocess.CalledProcessError` when `code` fails.

        assert not imports_module("import torch, fulmen")
    """
    probe = f"{code}\nimport sys\nprint({module!r} in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=300, check=True)
    return result.stdout.strip().splitlines()[-1] == "True"
