"""Proxies: stand-ins for run-time values while a function is traced."""

from fulmen.proxies.tensor import TensorProxy, differentiable_value, dtype_short_name, is_proxy

__all__ = ["TensorProxy", "differentiable_value", "dtype_short_name", "is_proxy"]
