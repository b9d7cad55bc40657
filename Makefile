# Two entry points, each doing its own setup in a local virtualenv:
#   make demo   the main job: compare Dobb, Dion, Muon and AdamW on a small GPT
#   make test   the test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
# On CPU machines pin torch: 2.13.0 is a local CPU build, an unpinned torch pulls CUDA.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,bench,bpe,examples]"
	touch $@

.PHONY: test demo lint
test: $(VENV)/.installed
	$(PY) -m pytest -q

demo: $(VENV)/.installed
	$(PY) -m dobb compare

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
