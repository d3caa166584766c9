# Two commands: `make demo` and `make test`. Each sets up .venv on first use.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
# Prefect's temporary server takes 17-24 s to start on two cores; its default timeout is 20 s.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120

.PHONY: demo test lint format install clean bench bench-cuda scan

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The constraints file pins torch==2.13.0 (CPU build) and every other package:
# an unpinned torch would pull a multi-GB CUDA build. GPU users install their own torch.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

demo: install
	$(VENV)/bin/sdcguard demo --report artifacts/demo-report.json

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The suite waits partly on other processes and on time itself (Prefect servers, training
# ranks, an approval answered after a lease period): with two workers on two cores a sixth of
# the CPU sat idle, so three workers, each with its own session fixtures; a file's tests stay
# together. Files go out in collection order, which puts the slow end-to-end files first
# (tests/conftest.py): xdist's default reorder by test count would start them last.
# The fifteen slowest tests are printed at the end: where the budget goes.
TEST_WORKERS ?= 3

test: install lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

bench: install
	$(PY) benchmarks/fingerprint.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/webhook.py

# The detection benchmarks on a GPU (benchmarks/cuda.sh), run by a python whose torch has CUDA
# (the dev virtualenv's is the CPU build): PYTHON_CUDA, with torch and httpx importable.
PYTHON_CUDA ?= python3
bench-cuda:
	PYTHON=$(PYTHON_CUDA) benchmarks/cuda.sh bench-cuda

# Static security scan of deploy/ (Kubernetes manifests, Dockerfile). checkov pins versions
# the project's constraints cannot share, so it lives in a virtualenv of its own.
SCAN_VENV := .venv-scan
$(SCAN_VENV)/bin/checkov:
	$(PYTHON) -m venv $(SCAN_VENV)
	$(SCAN_VENV)/bin/pip install -q checkov==3.3.30

# A kustomize patch is a fragment (no security context of its own): the scan skips the patch
# files and scans every kustomization as `kubectl kustomize` renders it (tests/deploy/overlays.py).
SCAN_RENDERED := .scan-rendered
scan: $(SCAN_VENV)/bin/checkov $(STAMP)
	rm -rf $(SCAN_RENDERED)
	patches="$$($(PY) -m tests.deploy.overlays $(SCAN_RENDERED))" && \
	BC_SKIP_MAPPING=TRUE $(SCAN_VENV)/bin/checkov -d deploy -d $(SCAN_RENDERED) \
	  --framework kubernetes dockerfile --compact --quiet --skip-download \
	  $$(for p in $$patches; do printf -- '--skip-path %s ' "$$p"; done)

clean:
	rm -rf $(VENV) $(SCAN_VENV) $(SCAN_RENDERED) .sdcguard artifacts .mypy_cache .ruff_cache .pytest_cache
