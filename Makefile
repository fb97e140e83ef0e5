# Two commands do all set-up on a fresh machine with Python 3.11:
#   make demo   -> trains the tiny model with dora on the embedded NATS (CPU)
#   make test   -> the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.dora-installed
TORCH ?= torch==2.13.0

.PHONY: demo test lint bench-all clean vllm test-vllm

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

# Two workers, a file at a time (a file's module fixtures stay in one process): most tests
# wait on real processes and servers, so two cores run the suite in about half the time.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

# The vllm extra in a venv of its own: vLLM brings newer numpy and transformers than the
# main venv's, and its wheel pulls torchvision/torchaudio/torchcodec, which dora does not use.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.dora-installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/pip install -q -e ".[dev,vllm]" "$(TORCH)"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -m vllm

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .dora-cache
