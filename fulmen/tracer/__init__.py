"""The tracer: runs a function or `nn.Module` once on proxies and records a Trace."""

from fulmen.tracer import formatting, seeding
from fulmen.tracer.guards import CacheKeyBuilder
from fulmen.tracer.tracer import TracedProgram, trace_program

seeding.install()
formatting.install()

__all__ = ["CacheKeyBuilder", "TracedProgram", "trace_program"]
