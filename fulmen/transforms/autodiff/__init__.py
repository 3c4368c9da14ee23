"""Reverse-mode autodiff: VJP rules (one registry) and the forward/backward split."""

from fulmen.transforms.autodiff import (  # noqa: F401  (importing registers the rules)
    rules,
    rules_attention,
    rules_composite,
    rules_edges,
    rules_losses,
    rules_nn,
    rules_structural,
)
from fulmen.transforms.autodiff.registry import has_rule, rule_for, vjp_rule
from fulmen.transforms.autodiff.split import ForwardBackward, split_forward_backward

__all__ = [
    "ForwardBackward",
    "has_rule",
    "rule_for",
    "split_forward_backward",
    "vjp_rule",
]
