"""Why the dispatcher (`fulmen.tracer.dispatch`) runs a call eagerly: one `RunsEagerly` kind per
question a trace cannot answer or replay (a lazy module's parameters, grad enabled inside
no_grad, a tensor hook, a closed-over tensor's offset, a tensor's address, a lazy conj/neg
bit)."""

from __future__ import annotations

from fulmen.core import RunsEagerly


class LazyParameters(RunsEagerly):
    """The traced code reads a parameter or buffer a lazy module (`nn.LazyLinear`) has not
    materialised: it has no sizes until that module's first call, which runs eagerly; the
    calls after it trace again."""

    remembered = False


class GradInsideNoGrad(RunsEagerly):
    """Called with grad disabled, the traced code enables grad and computes on a tensor that
    requires grad (its graph would be the caller's): the call runs eagerly."""


class TensorHookInTrace(RunsEagerly):
    """The traced code registers a hook on a tensor (`y.register_hook(fn)`, `y.retain_grad()`;
    Lightning Fabric's module wrapper hooks every output): the call runs eagerly, where the
    hook fires."""




class CapturedOffsetRead(RunsEagerly):
    """The traced code reads `storage_offset()` of a tensor it closes over (a global, a tensor
    attribute): the key holds no such offset (`m.t.data = flat[5:9]` keeps the tensor), so the
    call runs eagerly."""


class StorageIdentityRead(RunsEagerly):
    """The traced code asks where a tensor's memory lies (`x.data_ptr()`,
    `x.untyped_storage()`: packed-projection or alignment checks): no trace can answer or
    guard it (every call's tensors lie elsewhere), so the call runs eagerly."""


class LazyBitQuery(RunsEagerly):
    """The traced code asks whether a tensor's conjugate or negative bit is set (`z.is_conj()`,
    true of `z.conj()` until it is resolved): a proxy carries neither bit, nor does the cache
    key tell an argument with one from one without, so the call runs eagerly (a traced answer
    was False, and a branch on it took the other path)."""


__all__ = ["CapturedOffsetRead", "GradInsideNoGrad", "LazyBitQuery", "LazyParameters",
           "StorageIdentityRead", "TensorHookInTrace"]
