"""Snapshot tests of printed traces (update with EXPECTTEST_ACCEPT=1)."""

import expecttest
import torch

import fulmen


def scale_shift(x, w):
    y = x * w
    return y + 2


def two_outputs(x):
    return {"double": x * 2, "parts": (x - 1, 3)}


class TestPrinter(expecttest.TestCase):
    def test_traced_and_execution_traces(self):
        jfn = fulmen.jit(scale_shift, executors=["torch"])
        jfn(torch.ones(2, 3), torch.ones(3))
        traced, *_, final = fulmen.last_traces(jfn)
        self.assertExpectedInline(
            _strip_timing(str(traced)),
            """\
# fulmen · computation · constructed by tracing
import torch
from fulmen.ops import ltorch
from fulmen.ops import prims

def computation(x, w):
  # x: "cpu f32[2, 3]"
  # w: "cpu f32[3]"

  # test_printer.py:10  y = x * w
  t1 = ltorch.mul(x, w)  # t1: "cpu f32[2, 3]"
    # t0 = prims.broadcast_in_dim(w, (2, 3), (1,))
    # t1 = prims.mul(x, t0)
  # test_printer.py:11  return y + 2
  t2 = ltorch.add(t1, 2)  # t2: "cpu f32[2, 3]"
    # t2 = prims.add(t1, 2)
  return t2
""",
        )
        self.assertExpectedInline(
            _strip_timing(str(final)),
            """\
# fulmen · computation · after delete last used
import torch

def computation(x, w):
  # x: "cpu f32[2, 3]"
  # w: "cpu f32[3]"

  # test_printer.py:10  y = x * w
  t1 = torch.mul(x, w)  # t1: "cpu f32[2, 3]"
  del x, w
  # test_printer.py:11  return y + 2
  t2 = torch.add(t1, 2)  # t2: "cpu f32[2, 3]"
  del t1
  return t2
""",
        )

    def test_nested_output_and_constants(self):
        jfn = fulmen.jit(two_outputs)
        out = jfn(torch.ones(2))
        self.assertEqual(out["parts"][1], 3)
        final = fulmen.last_traces(jfn)[-1]
        self.assertIn("return {'double': t0, 'parts': (t1, 3)}", str(final))

    def test_html_repr_is_highlighted(self):
        jfn = fulmen.jit(scale_shift)
        jfn(torch.ones(2, 3), torch.ones(3))
        html = fulmen.last_traces(jfn)[-1]._repr_html_()
        self.assertIn("<span", html)
        self.assertIn("computation", html)


def _strip_timing(source: str) -> str:
    first, rest = source.split("\n", 1)
    return first.split(" (")[0] + "\n" + rest
