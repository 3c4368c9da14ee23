"""Proxies: stand-ins for run-time values while a function is traced."""

from fulmen.proxies.tensor import TensorProxy, dtype_short_name, is_proxy

__all__ = ["TensorProxy", "dtype_short_name", "is_proxy"]
