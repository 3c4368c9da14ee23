# Every target creates/updates .venv first, so a fresh clone needs only `make test` / `make demo`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench conformance fuzz mutants sweep clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

# one pytest worker per core (pytest-xdist); a file's tests stay on one worker (`loadfile`):
# module fixtures, and test_distributed's process groups, run once and never side by side
test: $(STAMP)
	$(BIN)/python -m pytest -q -x --timeout=900 -n auto --dist loadfile tests

demo: $(STAMP)
	$(BIN)/python examples/train_gpt.py

lint: $(STAMP)
	$(BIN)/ruff check fulmen tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

conformance: $(STAMP)
	$(BIN)/python -m tests.conformance.run_conformance --samples 3
	$(BIN)/python -m pytest -q tests/ops/test_opinfo.py -m "slow or not slow" --opinfo-samples=all
	$(BIN)/python -m pytest -q tests/ops/test_strides.py --opinfo-samples=all
	$(BIN)/python -m pytest -q tests/ops/test_opinfo_errors.py tests/ops/test_opinfo_inplace.py \
		tests/ops/test_opinfo_out.py tests/ops/test_opinfo_autocast.py --opinfo-samples=all
	FULMEN_DYNAMIC=strict $(BIN)/python -m pytest -q tests/ops/test_opinfo.py tests/ops/test_opinfo_grad.py
	FULMEN_DYNAMIC=strict $(BIN)/python -m pytest -q tests/ops/test_opinfo_dynamic.py -m "slow or not slow" --opinfo-samples=all

# >= 100,000 programs across the generators (op-level x3 executor lists, graph breaks, models
# x3); writes tests/fuzz/SUMMARY.md. FULMEN_FUZZ_PROGRAMS / FULMEN_FUZZ_SEED change the budget.
fuzz: $(STAMP)
	$(BIN)/python -m tests.fuzz.run_fuzz $${FULMEN_FUZZ_PROGRAMS:-100000} --seed $${FULMEN_FUZZ_SEED:-0}

# Planted miscompiles (tests/fuzz/mutant_table.py), each run against its pytest subset in a
# temporary copy of fulmen; writes tests/fuzz/MUTANTS.md. MUTANTS_ARGS="--only NAME" for some.
mutants: $(STAMP)
	nice -n 10 $(BIN)/python -m tests.fuzz.mutants --baseline --write tests/fuzz/MUTANTS.md $(MUTANTS_ARGS)

# Every model type of transformers' causal and seq2seq LM mappings (tiny configs, random weights:
# training step, eval at two lengths, greedy and sampled generate vs eager; hours on a laptop)
# and one litgpt config per family. SWEEP_ARGS="--types gpt2,bart --jobs 2" for some.
sweep: $(STAMP)
	nice -n 10 $(BIN)/python -m tests.sweeps.hf_sweep $(SWEEP_ARGS)
	nice -n 10 $(BIN)/python -m tests.sweeps.litgpt_sweep

clean:
	rm -rf $(VENV) build *.egg-info
