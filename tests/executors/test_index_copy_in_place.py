"""executors/torch/inplace_index.py: `index_copy_` into an input that the trace only updates
(a static KV cache) runs in place, without the write-back's copy of the whole buffer."""

import torch

import fulmen


def _update(cache, pos, new):
    cache.index_copy_(2, pos, new)
    return cache * 2, cache[:, :, :3]


def _names(jfn) -> list[str]:
    return [b.sym.name for b in fulmen.last_traces(jfn)[-1].bsyms]


def _check(fn, *make):
    """Run jitted and eager on equal copies of the inputs; compare results and the inputs."""
    jfn = fulmen.jit(fn)
    for _ in range(2):  # traced, then cached
        args, ref = make[0](), make[0]()
        got, want = jfn(*args), fn(*ref)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for a, r in zip(args, ref):
            torch.testing.assert_close(a, r, rtol=0, atol=0)
    return jfn, args, got


def _inputs():
    torch.manual_seed(0)
    return torch.randn(1, 2, 16, 4), torch.tensor([5, 6]), torch.randn(1, 2, 2, 4)


def test_a_cache_update_runs_in_place_and_returns_views_of_the_cache():
    jfn, (cache, _, _), (_, view) = _check(_update, _inputs)
    names = _names(jfn)
    assert "index_copy_in_place" in names and "Tensor_index_copy" not in names
    assert "copy_" not in names  # no write-back: the buffer was written in place
    assert view.data_ptr() == cache.data_ptr()  # eager's view of the updated cache


def test_a_cache_read_before_its_update_keeps_the_functional_update():
    def fn(cache, pos, new):  # one fused region reads the cache before and after the update
        before = cache * 3
        cache.index_copy_(2, pos, new)
        return before + cache

    jfn, _, _ = _check(fn, _inputs)
    assert "index_copy_in_place" not in _names(jfn)


def test_a_view_taken_before_the_update_sees_it_as_in_eager():
    def fn(cache, pos, new):
        head = cache[:, 1]
        cache.index_copy_(2, pos, new)
        return head * 1

    _check(fn, _inputs)


def test_an_updated_cache_saved_for_backward_gives_eagers_gradients():
    weight = torch.randn(4, requires_grad=True)

    def fn(cache, pos, new):
        cache.index_copy_(2, pos, new)
        return (cache * weight).sum()

    jfn = fulmen.jit(fn)
    cache, pos, new = _inputs()
    ref = cache.clone()
    fn(ref, pos, new).backward()
    grad, weight.grad = weight.grad, None
    jfn(cache, pos, new).backward()
    torch.testing.assert_close(cache, ref, rtol=0, atol=0)
    torch.testing.assert_close(weight.grad, grad)
