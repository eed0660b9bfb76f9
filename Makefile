# Two entry points for a fresh machine (see README):  make demo   |   make test
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a plain `torch` requirement could pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/ckpt demo

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2

.PHONY: install demo test
