"""When codegen compiles (lazy: torch runs a region until it is hot; eager: compile when fused)."""

import pytest
import torch

import fulmen
from fulmen.executors.codegen import build as policy
from fulmen.executors.codegen import set_compile_policy, wait_for_kernels
from fulmen.executors.codegen.cpu import compiler as cg_build
from fulmen.executors.codegen.cpu import runtime

EXECUTORS = ["codegen", "torch"]


@pytest.fixture
def lazy(tmp_path, monkeypatch):
    monkeypatch.setenv("FULMEN_CACHE_DIR", str(tmp_path))  # an empty kernel cache
    previous = set_compile_policy("lazy", hot_calls=3)
    builds = []
    real_build = cg_build._build

    def counting_build(source, *args):
        builds.append(source)
        return real_build(source, *args)

    monkeypatch.setattr(cg_build, "_build", counting_build)
    monkeypatch.setattr(cg_build, "_loaded", {})  # no kernel loaded by an earlier test
    monkeypatch.setattr(policy, "_jobs", {})
    yield builds
    set_compile_policy(previous.mode, previous.hot_calls)


def _regions(jfn):
    trace = fulmen.last_traces(jfn)[-1]
    return [b.sym.impl for b in trace.bsyms if isinstance(b.sym.impl, runtime.FusedRegion)]


def _fallback_calls(region, monkeypatch):
    calls = []
    real = region._run_fallback

    def spy(inputs):
        calls.append(1)
        return real(inputs)

    monkeypatch.setattr(region, "_run_fallback", spy)
    return calls


def fn(x, y):
    return torch.tanh(x * y + 1.5) - y


def test_lazy_region_runs_torch_until_hot_then_its_kernel(lazy, monkeypatch):
    x, y = torch.randn(64, 33), torch.randn(64, 33)
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    torch.testing.assert_close(jfn(x, y), fn(x, y))
    (region,) = _regions(jfn)
    fallbacks = _fallback_calls(region, monkeypatch)
    torch.testing.assert_close(jfn(x, y), fn(x, y))
    assert lazy == [] and len(fallbacks) == 1  # two calls: not hot, nothing compiled
    torch.testing.assert_close(jfn(x, y), fn(x, y))  # the third call starts the compile
    wait_for_kernels(fulmen.last_traces(jfn)[-1])
    assert len(lazy) == 1
    before = len(fallbacks)
    torch.testing.assert_close(jfn(x, y), fn(x, y))
    assert len(fallbacks) == before  # the kernel ran


def test_lazy_loads_a_kernel_already_in_the_disk_cache(lazy, monkeypatch):
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    set_compile_policy("eager")
    first = fulmen.jit(fn, executors=EXECUTORS)
    first(x, y)
    assert len(lazy) == 1
    set_compile_policy("lazy")
    jfn = fulmen.jit(fn, executors=EXECUTORS)  # a new function, the same region
    jfn(x, y)
    (region,) = _regions(jfn)
    region.wait()
    fallbacks = _fallback_calls(region, monkeypatch)
    torch.testing.assert_close(jfn(x, y), fn(x, y))
    assert fallbacks == [] and len(lazy) == 1  # loaded from disk on its first call


def test_eager_policy_compiles_before_the_first_call_returns(lazy, monkeypatch):
    set_compile_policy("eager")
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(jfn(x, y), fn(x, y))
    (region,) = _regions(jfn)
    assert region.ready() and len(lazy) == 1


def test_policy_arguments_are_checked():
    with pytest.raises(ValueError, match="lazy.*eager"):
        set_compile_policy("sometimes")
    with pytest.raises(ValueError, match="hot_calls"):
        set_compile_policy(hot_calls=0)


def test_a_failed_build_is_started_again_by_the_next_caller():
    """Builds are shared by key while they run; one that failed (a compiler killed, a full
    disk) must not keep its error for every later caller of that key."""
    key = ("test: a build failing once", id(object()))
    attempts = []

    def flaky():
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("the first build fails")
        return "built"

    with pytest.raises(OSError):
        policy.submit(key, flaky).result()
    assert policy.submit(key, flaky).result() == "built"
    assert len(attempts) == 2


def test_lazy_runs_a_cached_kernel_of_a_new_layout_on_its_first_call(lazy, monkeypatch):
    """NOTE [a cached kernel is loaded at once]: a layout whose kernel is in the disk cache
    runs that kernel on the region's first call, not torch (a fallback per cold layout)."""
    x, y = torch.randn(33, 64).t(), torch.randn(64, 33)  # x strided: not the contiguous layout
    set_compile_policy("eager")
    fulmen.jit(fn, executors=EXECUTORS)(x, y)  # builds this region's kernels for both layouts
    built = len(lazy)
    set_compile_policy("lazy")
    monkeypatch.setattr(cg_build, "_loaded", {})  # only the disk cache has them
    fallbacks = []
    real = runtime.FusedRegion._run_fallback

    def spy(self, inputs):
        fallbacks.append(self.name)
        return real(self, inputs)

    monkeypatch.setattr(runtime.FusedRegion, "_run_fallback", spy)
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    torch.testing.assert_close(jfn(x, y), fn(x, y))
    assert fallbacks == [] and len(lazy) == built  # loaded from the disk, nothing compiled


def test_a_region_sharing_plans_waits_for_its_own_kernel(lazy, monkeypatch, tmp_path):
    """Regions of one signature share call plans (`plans.plan_table`), not compiles: a new
    region calling a plan another region made runs its own kernel, when its own policy has
    it (eager: its first call waits for it)."""
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    set_compile_policy("eager")
    first = fulmen.jit(fn, executors=EXECUTORS)
    first(x, y)
    (shared,) = _regions(first)
    monkeypatch.setattr(cg_build, "_loaded", {})  # a kernel this process has not loaded
    monkeypatch.setattr(policy, "_jobs", {})
    monkeypatch.setenv("FULMEN_CACHE_DIR", str(tmp_path / "other"))  # nor finds on disk
    jfn = fulmen.jit(fn, executors=EXECUTORS)
    torch.testing.assert_close(jfn(x, y), fn(x, y))
    (region,) = _regions(jfn)
    assert region._plans is shared._plans
    # (how many builds ran is not asked: one xdist worker's clean-clone run built once here,
    # after an earlier file; the region's own kernel, called by the plan, is what counts)
    assert region.ready() and len(lazy) >= 1
    (plan,) = region._plans.values()
    assert plan.fn is region._ready[plan.layout]
