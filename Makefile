# Entry points, each doing its own setup in a local virtualenv:
#   make demo            the main job: compare the optimizers on a small GPT
#   make test            the test suite
#   make lint            ruff check and ruff format --check
#   make dist            the sdist and the wheel in dist/ (python -m build), twine check --strict
#   make install-check   the built wheel, installed without extras, builds and steps every
#                        optimizer; with the train extra it runs the quick start
#   make test-torchtitan torchtitan with dobb's optimizers on 2 gloo ranks (its own stage)
# CI (.ci/run) runs test, lint, dist, install-check and test-torchtitan; `pip check` follows
# every install.
VENV ?= .venv
PY := $(VENV)/bin/python
# On CPU machines pin torch: 2.13.0 is a local CPU build, an unpinned torch pulls CUDA.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,train,bench,bpe,examples]"
	$(PY) -m pip check
	touch $@

.PHONY: test demo lint dist install-check test-torchtitan
test: $(VENV)/.installed
	$(PY) -m pytest -q

demo: $(VENV)/.installed
	$(PY) -m bench compare

# torchtitan 0.3.0 for real on 2 gloo ranks (the torchtitan extra; deselected by `make test`)
test-torchtitan: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[torchtitan]"
	$(PY) -m pip check
	$(PY) -m pytest -q -m torchtitan tests/integrations

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# The sdist, then the wheel built from it (so the sdist holds what a build needs), each in an
# isolated environment with only [build-system] requires (setuptools from the index).
dist: $(VENV)/.installed
	rm -rf dist
	$(PY) -m build -o dist .
	$(VENV)/bin/twine check --strict dist/*

# installs the wheel `make dist` built (so `make install-check` alone builds it first)
install-check: dist
	TORCH="$(TORCH)" .ci/install_check $(PY) dist/*.whl
