# dlrm-vrgd — every entry point a newcomer needs. `make setup` is idempotent: it rebuilds the
# virtual environment only when pyproject.toml or requirements/ change.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip --disable-pip-version-check
PIN    := -c requirements/constraints.txt

.PHONY: setup demo test test-slow test-docker bench lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu-stack.txt requirements/torchrec.txt requirements/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(PIN) -r requirements/cpu-stack.txt
	$(PIP) install -q $(PIN) --no-deps -r requirements/torchrec.txt
	$(PIP) install -q --no-warn-conflicts $(PIN) -e ".[dev]"
	$(BIN)/python -c "import fbgemm_gpu, torchrec, dlrm_vrgd" 2>/dev/null
	touch $(STAMP)

demo: setup
	$(BIN)/dlrm-vrgd demo

test: setup
	$(BIN)/python -m pytest -m "not slow and not docker" -q

# The CPU image built and run with Compose (tests/deploy/test_image.py): needs Docker.
test-docker: setup
	$(BIN)/python -m pytest -m docker -q tests/deploy

test-slow: setup
	$(BIN)/python -m pytest -m slow -q

bench: setup
	$(BIN)/python bench/run_all.py

lint: setup
	$(BIN)/ruff check dlrm_vrgd service tests bench
	$(BIN)/ruff format --check dlrm_vrgd service tests bench

format: setup
	$(BIN)/ruff check --fix dlrm_vrgd service tests bench
	$(BIN)/ruff format dlrm_vrgd service tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
