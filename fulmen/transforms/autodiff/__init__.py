"""Reverse-mode autodiff: VJP rules (one registry) and the forward/backward split."""

from fulmen.ops.torch_autograd import (
    AUTOGRAD_BACKWARD,
    AUTOGRAD_FORWARD,
    AUTOGRAD_VJP,
    autograd_backward_impl,
    autograd_forward_impl,
    autograd_vjp_impl,
)
from fulmen.transforms.autodiff import (  # noqa: F401  (importing registers the rules)
    rules,
    rules_attention,
    rules_composite,
    rules_edges,
    rules_nn,
    rules_structural,
)
from fulmen.transforms.autodiff.registry import has_rule, rule_for, vjp_rule
from fulmen.transforms.autodiff.split import ForwardBackward, split_forward_backward

__all__ = [
    "AUTOGRAD_BACKWARD",
    "AUTOGRAD_FORWARD",
    "AUTOGRAD_VJP",
    "autograd_backward_impl",
    "autograd_forward_impl",
    "ForwardBackward",
    "autograd_vjp_impl",
    "has_rule",
    "rule_for",
    "split_forward_backward",
    "vjp_rule",
]
