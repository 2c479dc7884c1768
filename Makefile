# dlrm-vrgd — every entry point a newcomer needs. `make setup` is idempotent: it rebuilds the
# virtual environment only when pyproject.toml or requirements/ change.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip --disable-pip-version-check
PIN    := -c requirements/constraints.txt

.PHONY: setup demo test test-slow test-docker bench docs reference lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu-stack.txt requirements/torchrec.txt requirements/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(PIN) -r requirements/cpu-stack.txt
	$(PIP) install -q $(PIN) --no-deps -r requirements/torchrec.txt
	$(PIP) install -q --no-warn-conflicts $(PIN) -e ".[dev,docs,service,onnx,tracking,study]"
	$(BIN)/python -c "import fbgemm_gpu, torchrec, dlrm_vrgd" 2>/dev/null
	touch $(STAMP)

demo: setup
	$(BIN)/dlrm-vrgd demo

test: setup
	$(BIN)/python -m pytest -m "not slow and not docker" -q -n 2 --dist loadgroup --durations=40

# The CPU image built and run with Compose (tests/deploy/test_image.py): needs Docker.
test-docker: setup
	$(BIN)/python -m pytest -m docker -q tests/deploy

test-slow: setup
	$(BIN)/python -m pytest -m slow -q

bench: setup
	$(BIN)/python bench/run_all.py

# The documentation site, built strictly into site/ (a broken link or anchor, or a page left out
# of the nav, fails it). The generated references must match the config schema and the
# service's routes first.
docs: setup
	$(BIN)/python docs/gen_config_reference.py --check
	$(BIN)/python docs/gen_api_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Rewrite the generated parts of docs/configuration.md (from dlrm_vrgd/config.py) and
# docs/api.md (from the service's OpenAPI schema).
reference: setup
	$(BIN)/python docs/gen_config_reference.py
	$(BIN)/python docs/gen_api_reference.py

lint: setup
	$(BIN)/ruff check dlrm_vrgd service tests bench examples docs/*.py docs/study/*.py
	$(BIN)/ruff format --check dlrm_vrgd service tests bench examples docs/*.py docs/study/*.py

format: setup
	$(BIN)/ruff check --fix dlrm_vrgd service tests bench examples docs/*.py docs/study/*.py
	$(BIN)/ruff format dlrm_vrgd service tests bench examples docs/*.py docs/study/*.py

clean:
	rm -rf $(VENV) runs models site .pytest_cache .ruff_cache
