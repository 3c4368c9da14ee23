"""Layout comparisons shared by tests."""

import torch

__all__ = ["significant_strides"]


def significant_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """The strides of `tensor`'s dimensions of size other than 1.

    Those of size 1 never change which element is where, and eager's own kernels disagree on
    them (TensorIterator keeps an input's stride there, a convolution's backward its own);
    `torch.autograd`'s layout contract for `.grad` ignores them too.
    """
    return tuple(s for n, s in zip(tensor.shape, tensor.stride()) if n != 1)
