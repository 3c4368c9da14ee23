"""The IR of fulmen: traces, symbols, bound symbols, names, printing and verification.

`core` imports nothing else from fulmen; every other part builds on it.
"""

from fulmen.core.check import check_trace
from fulmen.core.errors import FulmenError, NotYetSupportedError, RunsEagerly
from fulmen.core.proxy import Proxy
from fulmen.core.source import SourceLocation
from fulmen.core.symbol import BoundSymbol, CallSiteTag, Symbol, Tag, any_tagged, flatten
from fulmen.core.trace import Trace, TraceCtx, get_tracectx, tracing

__all__ = [
    "BoundSymbol",
    "FulmenError",
    "NotYetSupportedError",
    "RunsEagerly",
    "Proxy",
    "SourceLocation",
    "Symbol",
    "Tag",
    "CallSiteTag",
    "Trace",
    "TraceCtx",
    "check_trace",
    "any_tagged",
    "flatten",
    "get_tracectx",
    "tracing",
]
