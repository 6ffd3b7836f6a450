# Set-up and everyday commands. `make install` then `make test` is all a fresh clone needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.DEFAULT_GOAL := help
.PHONY: help install lock upgrade test test-long fuzz test-fast test-gpu lint docs docs-build bench bench-gpu bench-peer bench-pipeline bench-tests train tensorboard tensorboard-shots devices clean

help:  ## this list: every target and what it does
	@awk 'BEGIN {FS = ":.*##"} /^[a-z][a-z-]*:.*##/ {printf "  make %-18s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# exactly the versions in the lock, hash-checked, compiled to bytecode once (every process imports lightning). uv
# trusts what a venv already holds: a lock that differs from the one last installed reinstalls all, hashes checked.
LOCK ?= requirements.lock
install: $(BIN)/python  ## create .venv with the locked versions, then this project
	$(BIN)/pip install --quiet "$$(sed -n 's/^\(uv==[^ ]*\).*/\1/p' $(LOCK))"
	$(BIN)/uv pip sync --quiet --python $(BIN)/python --compile-bytecode --require-hashes \
		$$(cmp -s $(LOCK) $(VENV)/installed.lock || echo --reinstall) $(LOCK)
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e .
	cp $(LOCK) $(VENV)/installed.lock

# the versions make test just passed with, resolved for every platform
lock:  ## record what .venv holds in requirements.lock
	$(BIN)/uv pip freeze --python $(BIN)/python --exclude-editable > .venv/tested.txt
	$(BIN)/uv pip compile --quiet pyproject.toml --extra dev --universal --generate-hashes \
		--constraint .venv/tested.txt --custom-compile-command "make lock" --output-file requirements.lock

# then make test, make lock, and commit the lock
upgrade:  ## move .venv to the newest versions pyproject.toml allows
	$(BIN)/uv pip install --python $(BIN)/python --upgrade -e ".[dev]"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# three test files at a time on 2 cores: many tests wait on processes they started
test:  ## the suite, end-to-end tests and every doc command included, less the longest (make test-long)
	$(BIN)/pytest -n 3 --dist loadfile -m "not long"

test-long:  ## the longest end-to-end tests: several nodes, SLURM requeues, kills mid-save (CI runs them)
	$(BIN)/pytest -n 3 --dist loadfile -m long

fuzz:  ## the generated-input tests with FUZZ_EXAMPLES (default 500) cases each, not make test's few
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-500} $(BIN)/pytest -n 2 tests/test_fuzz.py

test-fast:  ## everything but the end-to-end and multi-process tests
	$(BIN)/pytest -m "not slow"

# tests/test_gpu.py and the tests that skip without CUDA
test-gpu:  ## on a CUDA GPU: what CPU runs cannot show
	$(BIN)/pytest -m gpu -rsP

lint:  ## style and types: ruff's checks and formatting (120 columns), mypy on src/
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

docs:  ## serve the documentation site (docs/) at http://127.0.0.1:8000
	$(BIN)/mkdocs serve

docs-build:  ## build the documentation site into site/, every warning an error (CI runs it)
	$(BIN)/mkdocs build --strict --quiet

# benchmarks/results/*.{json,png} and profile.txt (benchmarks/README.md)
bench:  ## the speed suite on CPU (about 20 minutes)
	$(BIN)/python benchmarks/startup.py
	$(BIN)/python benchmarks/whole_run.py
	$(BIN)/python benchmarks/step_loop.py
	$(BIN)/python benchmarks/speedups.py
	$(BIN)/python benchmarks/figures.py
	$(BIN)/python benchmarks/graph.py
	$(BIN)/python benchmarks/per_call.py
	$(BIN)/python benchmarks/data_path.py
	$(BIN)/python benchmarks/ddp.py
	$(BIN)/python benchmarks/scaling.py
	$(BIN)/python benchmarks/profile_run.py

# benchmarks/results/step_loop_gpu.{json,png} and gpu_models_<device>.{json,png}
bench-gpu:  ## on one CUDA GPU: the step loop, and ResNet-50 and a GPT-2-small, against bare Lightning there
	$(BIN)/python benchmarks/step_loop.py --accelerator gpu
	$(BIN)/python benchmarks/gpu_models.py

# its venv needs rootutils and hydra-colorlog from pip
bench-peer:  ## the startup and whole-run figures against lightning-hydra-template
	$(BIN)/python benchmarks/peer.py --setup
	$(BIN)/python benchmarks/startup.py
	$(BIN)/python benchmarks/whole_run.py

# benchmarks/results/test_suite.json; run it on a quiet machine
bench-tests:  ## what make test costs: wall, CPU, the ten slowest tests
	$(BIN)/python benchmarks/test_suite.py

# benchmarks/results/pipeline.{json,png}
bench-pipeline:  ## one device vs a plain split vs a pipelined split
	$(BIN)/python benchmarks/pipeline.py

train:  ## train the default model on the default data
	$(BIN)/python train.py

tensorboard:  ## inspect every run under logs/
	$(BIN)/tensorboard --logdir logs

tensorboard-shots:  ## screenshots of the newest run's TensorBoard pages (needs Chromium)
	$(BIN)/python -m engine.loggers.screenshots logs

devices:  ## what this machine offers and what the default trainer would pick
	$(BIN)/python -m engine.launch.devices

clean:  ## remove run outputs (not data, not .venv)
	rm -rf logs outputs multirun lightning_logs .pytest_cache
