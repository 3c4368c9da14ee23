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


_INJECTED = "  import builtins; builtins.fulmen_injected = True"  # indented as trace bodies are


def negate(x):
    return -x


class TestUserTextInPrintedTraces(expecttest.TestCase):
    """Text that is not fulmen's (file names, source lines, graph-break questions, symbol names,
    provenance) is compiled with the printed trace: it must stay inside its comment."""

    def setUp(self):
        self.x = torch.randn(2, 3)
        jfn = fulmen.jit(scale_shift, executors=["torch"])
        jfn(self.x, torch.ones(3))
        self.traced = fulmen.last_traces(jfn)[0]

    def tearDown(self):
        import builtins

        injected = vars(builtins).pop("fulmen_injected", False)
        self.assertFalse(injected, "user text ran as code of a printed trace")

    def assert_safe_and_runs(self, trace):
        source = str(trace)
        self.assertEqual(len(source.splitlines()), source.count("\n"), source)
        out = trace.python_callable()(self.x, torch.ones(3))
        torch.testing.assert_close(out, scale_shift(self.x, torch.ones(3)))
        return source

    def test_source_location_and_provenance(self):
        from fulmen.core.source import SourceLocation

        evil = f"\n{_INJECTED}\r{_INJECTED}\u2028#"
        first = self.traced.bsyms[0].replace(source=SourceLocation(f"m.py{evil}", 1, f"y{evil}"))
        trace = self.traced.replace(bsyms=(first, *self.traced.bsyms[1:]),
                                    provenance=f"after my pass\n{_INJECTED.strip()}")
        source = self.assert_safe_and_runs(trace)
        self.assertIn("# m.py\\n  import builtins; builtins.fulmen_injected = True\\r", source)

    def test_graph_break_question(self):
        from fulmen.core.symbol import BoundSymbol
        from fulmen.ops.breaks import GUARD

        t1 = self.traced.bsyms[0].output
        question = f"bool(t1)\n{_INJECTED}\x85"
        guard = BoundSymbol(GUARD, (question, torch.Tensor.dim, 2, t1))
        trace = self.traced.replace(bsyms=(self.traced.bsyms[0], guard, *self.traced.bsyms[1:]))
        source = self.assert_safe_and_runs(trace)
        self.assertIn("# graph break: bool(t1)\\n  import builtins", source)
        self.assertIn("breaks.guard('bool(t1)\\n  import builtins", source)

    def test_symbol_names_that_are_not_python_names(self):
        # a custom autograd.Function (or a user executor's operator) can be named anything
        from fulmen.core.symbol import Namespace, Symbol

        jfn = fulmen.jit(negate, executors=["torch"])
        jfn(self.x)
        traced = fulmen.last_traces(jfn)[0]
        odd = Symbol("odd", None, namespace=Namespace("user_ns", None, ""), impl=torch.neg,
                     python_name=f"user_ns.odd\n{_INJECTED}\n  x = ")
        bsym = traced.bsyms[0]
        trace = traced.replace(bsyms=(bsym.replace(sym=odd, subsymbols=(bsym.replace(sym=odd),)),))
        source = str(trace)
        self.assertEqual(len(source.splitlines()), source.count("\n"), source)
        self.assertIn("= _c0(x)", source)
        torch.testing.assert_close(trace.python_callable()(self.x), -self.x)

    def test_local_shadowing_a_global_is_refused(self):
        from fulmen.core import FulmenError
        from fulmen.proxies import TensorProxy

        jfn = fulmen.jit(negate, executors=["torch"])
        jfn(self.x)
        traced = fulmen.last_traces(jfn)[0]
        shadow = TensorProxy("ltorch", self.x.shape, self.x.dtype, self.x.device)
        bsym = traced.bsyms[0].replace(args=(shadow,), subsymbols=())
        trace = traced.replace(args=(shadow,), bsyms=(bsym,))
        with self.assertRaisesRegex(FulmenError, "'ltorch' cannot be printed"):
            str(trace)


def _strip_timing(source: str) -> str:
    first, rest = source.split("\n", 1)
    return first.split(" (")[0] + "\n" + rest


def test_printed_traces_import_ops_not_the_tracer_or_transforms():
    """The symbols printed traces call live in `fulmen.ops` (a mutation's functional forms and
    the ops autodiff runs under torch.autograd included): running a printed trace needs neither
    the tracer nor a transform."""

    def f(x, w):
        y = x * 2
        y[0].add_(1)  # functionalized.view_scatter
        return torch.cdist(y, w).sum()  # opaque: autodiff.autograd_forward / autograd_backward

    jfn = fulmen.jit(f)
    jfn(torch.randn(4, 3), torch.randn(5, 3, requires_grad=True)).backward()
    traces = fulmen.last_traces(jfn) + fulmen.last_backward_traces(jfn)
    printed = "\n".join(str(trace) for trace in traces)
    assert "functionalized.view_scatter(" in printed and "autodiff.autograd_forward(" in printed
    imports = {line for line in printed.splitlines() if line.startswith(("import ", "from "))}
    assert all(line == "import torch" or line.startswith(("from fulmen.ops import ",
                                                          "from fulmen.extend import "))
               for line in imports), imports
