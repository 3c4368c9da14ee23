"""Threads: first calls traced concurrently never leave proxies where user code can see them."""

import threading

import torch

import fulmen
from fulmen.proxies import TensorProxy


def test_four_threads_with_new_shapes_see_no_proxies():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    for trial in range(30):
        jmodel = fulmen.jit(model)
        errors, results = [], {}

        def worker(index, jmodel=jmodel, errors=errors, results=results, trial=trial):
            try:
                x = torch.randn(index + 1 + trial % 3, 8)  # a new shape per thread: a trace each
                with torch.no_grad():
                    results[index] = (x, jmodel(x))
                    model(x)  # eager use of the module while other threads trace
            except Exception as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert not any(isinstance(p, TensorProxy) for p in model.parameters())
        with torch.no_grad():
            for x, out in results.values():
                torch.testing.assert_close(out, model(x))
