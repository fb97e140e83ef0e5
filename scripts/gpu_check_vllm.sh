#!/usr/bin/env bash
# The vLLM engine on a CUDA GPU: the engine contract tests (token identity with
# VLLM_BATCH_INVARIANT=1), then `dora bench migrate` (KV migration vs re-prefill at 1K and 4K
# context, re-prefilled tokens) and `dora bench engine` (vLLM through dora's protocol beside
# vLLM's own loop). Needs a venv with this repo and vllm==0.32.* (CUDA build) installed:
#   python -m venv .venv-gpu && .venv-gpu/bin/pip install -e '.[dev]' 'vllm==0.32.*'
#   PY=.venv-gpu/bin/python scripts/gpu_check_vllm.sh
# Prints the tables; the JSON lands under runs/bench/. The contract tests compare with the
# built-in engine on the CPU: on a GPU a token may differ by numerics alone (fp32 kernels of
# another device), which the test output shows token by token.
set -euo pipefail
PY="${PY:-.venv/bin/python}"
DORA="$(dirname "$PY")/dora"
cd "$(dirname "$0")/.."
"$PY" -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA GPU'; \
print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
export VLLM_BATCH_INVARIANT=1
"$PY" -m pytest -q -p no:cacheprovider tests/contract/test_engine_contract.py -k vllm
"$DORA" bench migrate --engines dora,vllm --models tiny,small --contexts 1024,4096
"$DORA" bench engine --models tiny,small --workloads uniform,longtail \
  --transformers-longtail bound
