# Two commands do all set-up on a fresh machine with Python 3.11:
#   make demo   -> trains the tiny model with dora on the embedded NATS (CPU)
#   make test   -> the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.dora-installed
TORCH ?= torch==2.13.0

.PHONY: demo test lint bench-all clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned, so pip never picks a multi-GB CUDA build for the range below
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dora run pipelines/quickstart.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) runs .dora-cache
