# The two commands of the README's quick start: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# The local CPU wheel on these machines; on a GPU node pass TORCH_SPEC="torch" (or a CUDA wheel).
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test lab bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[lab,test]"
	touch $@

setup: $(VENV)/.installed

data/cache/corpus.meta.json: setup data/prepare.py
	$(PY) data/prepare.py

demo: setup data/cache/corpus.meta.json
	$(PY) -m muonlab.cli demo

# ruff check first: pyflakes' findings ([tool.ruff] in pyproject.toml) across the repository, notebooks excepted.
# Then one pytest session over tests/ and notebooks/, on TEST_WORKERS xdist workers; --dist loadscope
# keeps a module's (and a notebook's) tests on one worker, so module fixtures launch once.
# tests/ includes tests/browser (JupyterLab in headless Chromium; skipped where none is installed)
# and tests/test_notebooks_at_default_size.py (every notebook sized by CI again with CI unset, --nbval-lax:
# the # NBVAL_CHECK_OUTPUT cells compared, so a run that breaks only after some steps fails).
# Notebooks: strict nbval, every cell not marked # NBVAL_IGNORE_OUTPUT compared with its stored
# output (notebooks/_store_outputs.py writes them), after notebooks/nbval_sanitize.cfg.
TEST_WORKERS ?= 2
test: setup data/cache/corpus.meta.json
	$(VENV)/bin/ruff check .
	CI=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope \
		--nbval --nbval-sanitize-with notebooks/nbval_sanitize.cfg tests notebooks

lab: setup data/cache/corpus.meta.json
	$(VENV)/bin/jupyter lab notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

clean:
	rm -rf $(VENV) runs notebooks/runs data/cache
