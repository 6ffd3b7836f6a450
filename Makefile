# Set-up and everyday commands. `make install` then `make test` is all a fresh clone needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install lock upgrade test test-fast test-gpu lint bench bench-gpu bench-peer bench-pipeline bench-tests train tensorboard tensorboard-shots devices clean

install: $(BIN)/python  ## create .venv with exactly the versions in requirements.lock (hash-checked, compiled to bytecode once: every process imports lightning), then the project
	$(BIN)/pip install --quiet "$$(sed -n 's/^\(uv==[^ ]*\).*/\1/p' requirements.lock)"
	$(BIN)/uv pip sync --quiet --python $(BIN)/python --compile-bytecode --require-hashes requirements.lock
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e .

lock:  ## record what .venv holds (the versions make test just passed with) in requirements.lock, every platform
	$(BIN)/uv pip freeze --python $(BIN)/python --exclude-editable > .venv/tested.txt
	$(BIN)/uv pip compile --quiet pyproject.toml --extra dev --universal --generate-hashes \
		--constraint .venv/tested.txt --custom-compile-command "make lock" --output-file requirements.lock

upgrade:  ## move .venv to the newest versions pyproject.toml allows; then make test, make lock, commit the lock
	$(BIN)/uv pip install --python $(BIN)/python --upgrade -e ".[dev]"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

test:  ## the whole suite, slow end-to-end tests included; three test files at a time on 2 cores (many tests wait on processes they started)
	$(BIN)/pytest -n 3 --dist loadfile

test-fast:  ## everything but the end-to-end and multi-process tests
	$(BIN)/pytest -m "not slow"

test-gpu:  ## on a machine with a CUDA GPU: what CPU runs cannot show (tests/test_gpu.py and the tests that skip without CUDA)
	$(BIN)/pytest -m gpu -rsP

lint:  ## style and types: ruff's checks and formatting (120 columns), mypy on src/
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench:  ## the speed suite, a few minutes on CPU: benchmarks/results/*.{json,png} and profile.txt (benchmarks/README.md)
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

bench-gpu:  ## on one CUDA GPU: the step loop against bare Lightning there, benchmarks/results/step_loop_gpu.{json,png}
	$(BIN)/python benchmarks/step_loop.py --accelerator gpu

bench-peer:  ## make the lightning-hydra-template's venv (pip: rootutils, hydra-colorlog), then the figures that use it
	$(BIN)/python benchmarks/peer.py --setup
	$(BIN)/python benchmarks/startup.py
	$(BIN)/python benchmarks/whole_run.py

bench-tests:  ## what `make test` costs (wall, CPU, ten slowest): benchmarks/results/test_suite.json; run it on a quiet machine
	$(BIN)/python benchmarks/test_suite.py

bench-pipeline:  ## one device vs plain split vs pipelined split: benchmarks/results/pipeline.{json,png}
	$(BIN)/python benchmarks/pipeline.py

train:  ## train the default model on the default data
	$(BIN)/python train.py

tensorboard:  ## inspect every run under logs/
	$(BIN)/tensorboard --logdir logs

tensorboard-shots:  ## screenshots of the newest run's scalars, HParams and images pages (needs Chromium)
	$(BIN)/python -m engine.loggers.screenshots logs

devices:  ## what this machine offers and what the default trainer would pick
	$(BIN)/python -m engine.launch.devices

clean:  ## remove run outputs (not data, not .venv)
	rm -rf logs outputs multirun lightning_logs .pytest_cache
