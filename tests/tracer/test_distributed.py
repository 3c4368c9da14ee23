"""`DDP(fulmen.jit(model))` and `fulmen.jit(DDP(model))` train exactly like single-process
eager: two CPU processes, gloo.

DDP's own forward runs eagerly around the compiled module (in both spellings), and its gradient
hooks fire as the compiled backward accumulates into the parameters, so gradients are
all-reduced on every step (also after `no_sync()` accumulation).
"""

import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fulmen

WORLD = 2
STEPS = 3
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def _batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)


def _micro_batches(step: int) -> int:
    return 2 if step == STEPS - 1 else 1  # the last step accumulates under no_sync()


def _train(model, step_fn) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        losses.append(step_fn(step))
        optimizer.step()
    return losses


def _worker(rank: int, port: int, out_dir: str, spelling: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _model()
        loss_fn = torch.nn.functional.mse_loss
        if spelling == "ddp_of_jit":
            ddp = torch.nn.parallel.DistributedDataParallel(fulmen.jit(model))
            compiled = ddp.module
        elif spelling == "jit_of_loss_of_ddp":  # the DDP is an argument: its calls run eagerly
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            compiled = fulmen.jit(lambda module, x, y: torch.nn.functional.mse_loss(module(x), y))
            loss_fn = None
        else:
            ddp = compiled = fulmen.jit(torch.nn.parallel.DistributedDataParallel(model))
            assert ddp.module is model
            assert list(ddp.state_dict()) == [f"module.{key}" for key in model.state_dict()]

        def step_fn(step: int) -> float:
            total = 0.0
            count = _micro_batches(step)
            for micro in range(count):
                x, y = _batch(step, micro)
                x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
                sync = micro == count - 1
                with ddp.no_sync() if not sync else torch.enable_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the eager fallback's warning
                    loss = compiled(ddp, x, y) if loss_fn is None else loss_fn(ddp(x), y)
                    loss.backward()
                total += loss.item()
            return total

        losses = _train(ddp, step_fn)
        params = [p.detach().clone() for p in model.parameters()]
        stats = {"cache_hits": fulmen.cache_hits(compiled), "misses": fulmen.cache_misses(compiled),
                 "eager_calls": fulmen.compile_stats(compiled).eager_calls}
        replaced = None
        if spelling == "jit_of_ddp":  # `ddp.module = other`: the compiled call runs `other`
            other = torch.nn.Sequential(torch.nn.Linear(8, 4))
            ddp.module = other
            with torch.no_grad():
                x = _batch(0)[0]
                replaced = bool(torch.equal(compiled(x), other(x)))
        torch.save({"params": params, "losses": losses, "replaced": replaced, **stats},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("spelling", ["ddp_of_jit", "jit_of_ddp", "jit_of_loss_of_ddp"])
def test_ddp_and_jit_equal_single_process_eager(tmp_path, spelling):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), spelling), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]

    model = _model()

    def step_fn(step: int) -> float:
        total = 0.0
        for micro in range(_micro_batches(step)):
            x, y = _batch(step, micro)
            # the mean over the full batch: what DDP's averaged half-batch gradients equal
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            total += loss.item()
        return total

    losses = _train(model, step_fn)
    for rank in ranks:
        if spelling == "jit_of_loss_of_ddp":  # was compiled, and skipped the all-reduce
            assert rank["eager_calls"] == STEPS + 1
        else:
            assert rank["replaced"] is not False  # None where not tried
            assert rank["cache_hits"] >= STEPS - 1  # compiled once, then served from the cache
            assert rank["misses"] == 1
        for actual, expected in zip(rank["params"], model.parameters()):
            torch.testing.assert_close(actual, expected.detach(), atol=1e-5, rtol=1e-5)
    # each rank's loss is over its half batch: their mean is the full-batch loss
    mean_losses = [sum(rank["losses"][step] for rank in ranks) / WORLD for step in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(losses), atol=1e-5,
                               rtol=1e-5)


def _fsdp_worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _model()
        # per-block sharding of compiled blocks: FSDP2's hooks gather and free the parameters
        # around each compiled call, as eagerly
        for index in (0, 3):
            model[index] = fully_shard(fulmen.jit(model[index]), mesh=mesh)
        fully_shard(model, mesh=mesh)
        with pytest.raises(fulmen.core.NotYetSupportedError, match="fully_shard"):
            fulmen.jit(model)

        def step_fn(step: int) -> float:
            x, y = _batch(step)
            x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss.item()

        losses = _train(model, step_fn)
        params = [p.full_tensor().detach() for p in model.parameters()]
        torch.save({"params": params, "losses": losses}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_of_jitted_blocks_equals_single_process_eager(tmp_path):
    mp.spawn(_fsdp_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    model = _model()

    def step_fn(step: int) -> float:
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss.item()

    losses = _train(model, step_fn)
    for rank in ranks:
        for actual, expected in zip(rank["params"], model.parameters()):
            torch.testing.assert_close(actual, expected.detach(), atol=1e-5, rtol=1e-5)
    mean_losses = [sum(rank["losses"][step] for rank in ranks) / WORLD for step in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(losses), atol=1e-5,
                               rtol=1e-5)


def _step_worker(rank: int, port: int, out_dir: str, wrap: bool) -> None:
    """A whole training step jitted (forward, `loss.backward()`, momentum SGD, `zero_grad`),
    closing over a DDP (or `fulmen.jit(DDP)`) and its optimizer: the call runs eagerly (DDP's
    gradient synchronisation), on the real optimizer."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp = fulmen.jit(ddp) if wrap else ddp
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x, y):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        jstep = fulmen.jit(step)
        for index in range(STEPS):
            x, y = _batch(index)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the eager fallback's warning
                jstep(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank])
        torch.save([p.detach().clone() for p in model.parameters()],
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrap", [False, True], ids=["ddp", "jit_of_ddp"])
def test_a_jitted_training_step_over_ddp_equals_single_process_eager(tmp_path, wrap):
    mp.spawn(_step_worker, args=(_free_port(), str(tmp_path), wrap), nprocs=WORLD, join=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for index in range(STEPS):
        x, y = _batch(index)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank in range(WORLD):
        for actual, expected in zip(torch.load(tmp_path / f"rank{rank}.pt"), model.parameters()):
            torch.testing.assert_close(actual, expected.detach(), atol=1e-5, rtol=1e-5)
