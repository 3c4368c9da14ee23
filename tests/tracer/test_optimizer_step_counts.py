"""A custom optimizer keeping a Python int step count in its per-parameter state
(`self.state[p]["step"] += 1`, read by its bias correction), jitted as `fulmen.jit(opt.step)`:
the int sits in the jitted function's own object (the bound method's `self`, a negative root),
and is traced as a symbol once it changes (`DynamicDims._ints_for`), keyed by its type in the
function's objects (`CacheKeyBuilder._fn_roots_key`) and checked by the shape guard. It
compiled at every step (8 entries, then eagerly)."""

import warnings

import torch

import fulmen


class _Lion(torch.optim.Optimizer):
    """Lion with a bias-corrected update (`1 - beta1 ** step`, a Python int step)."""

    def __init__(self, params, lr=0.01, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                if "m" not in state:
                    state["m"] = torch.zeros_like(p)
                m = state["m"]
                update = (m * beta1 + p.grad * (1 - beta1)) / (1 - beta1 ** state["step"])
                p.data.add_(torch.sign(update) * -group["lr"])
                # (no `alpha=`: eager's add with alpha may round once, by a fused multiply-add)
                m.mul_(beta2).add_(p.grad * (1 - beta2))


def _train(make_opt, jit: bool, steps: int = 10):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = make_opt(model.parameters())
    step = fulmen.jit(opt.step) if jit else opt.step
    x = torch.randn(5, 4)
    for _ in range(steps):
        model(x).square().sum().backward()
        step()
        opt.zero_grad()
    state = [value for per_param in opt.state.values() for value in per_param.values()]
    return [p.detach() for p in model.parameters()] + state, step


def _check(make_opt, most: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no cache-limit warning)
        got, step = _train(make_opt, True)
    want, _ = _train(make_opt, False)
    assert len(got) == len(want) > 2
    for a, b in zip(got, want):
        assert type(a) is type(b)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    stats = fulmen.compile_stats(step)
    assert stats.calls == 10 and stats.eager_calls == 0 and stats.cache_misses <= most


def test_a_python_int_step_count_in_optimizer_state_is_traced_as_a_symbol():
    """Three compilations over 10 steps: the first (empty state: another structure), step 1
    (a 1 is specialised, as torch.compile's) and one symbolic entry for steps 2 to 10."""
    _check(_Lion, 3)


def test_adamws_tensor_step_count_still_compiles_twice(monkeypatch):
    """torch's AdamW keeps `step` as a tensor: the int policy of the optimizer's own objects
    leaves it as it was (two compilations, eager's results; tiny kernels not fused, as in
    `test_host_floats`)."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")
    _check(lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1), 2)
