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
	# bubblewrap isolates model-written code (dora.envs.sandbox); without it the sandbox refuses
	command -v bwrap >/dev/null || ([ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get install -y -q bubblewrap || (apt-get update -q \
		&& apt-get install -y -q bubblewrap)) >/dev/null) \
		|| echo "note: bubblewrap not installed; the code sandbox will refuse to run code"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dora run pipelines/quickstart.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) runs .dora-cache
