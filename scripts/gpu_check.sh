#!/usr/bin/env bash
# The GPU run, in one call on a bare GPU machine without network: the GPU tests, then decode speed on random-weight
# checkpoints of the default model's configuration and of Llama-3.1-8B's, with gpt-fast and HF transformers in the
# same run (scripts/gpu_peers.py).  Results: results/gpu_*.json (and $OUT/, when set: the device tool brings it
# back), then one summary table.  docs/results.md section 14 holds what earlier runs measured.
#
#   bash scripts/gpu_check.sh --fetch [SRC]    here, before: fill the ignored gpu/ folder the run needs (gpt-fast's
#                                              generate.py, model.py, tokenizer.py at a pinned commit from SRC, a git
#                                              URL or clone, default GitHub's; the default checkpoint's config and
#                                              tokenizer files)
#   bash scripts/gpu_check.sh --dry-run        every step up to its first CUDA call (checks, the tests' collection,
#                                              the peers' configurations), and the commands it would run
#   bash scripts/gpu_check.sh [--parts tests,small,large,policies,table3,kivi]   the run (default: tests,small,large)
#
# Parts: tests (pytest -m 'gpu and not model' tests/test_gpu.py), small (the default model's configuration,
# batch 1 x 4096: ours eager and compiled, gpt-fast, HF), large (Llama-3.1-8B's, bf16, batch 1 x 4096: ours
# compiled, gpt-fast, HF; the benchmark's read bandwidth and fraction of it), policies (Llama-3.1-8B's: full, ds
# and hshare 1/2-1/2-1/2 at batch 16 x 4096, compiled), table3 (D2O's Table 3, first row, at equal KV memory:
# full at batch 8 for 256 + 1024 tokens, 10240 token slots; d2o and snapkv with the paper's budget, the prompt's
# 256 tokens, at 4x the batch: d2o holds 32 x 256 = 8192 slots, snapkv appends its 1024 generated tokens, so the
# same batch over-runs the memory full had: a run that fits the card, reported as such), kivi (full over 16-bit
# and KIVI 4-bit storage at batch 16 x 32768, the largest batch of the issue's 32k row whose 16-bit cache fits
# an H200's 141 GB beside 16 GB of weights).  Each part's commands are bounded by `timeout`.
# The device tool's call: carry ["gpu"], command `bash scripts/gpu_check.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."

GPU_DIR=${GPU_DIR:-gpu}
PY=${PYTHON:-python3}
GPT_FAST_COMMIT=32971d3129541c5bfb4f715abc33d1c5f408d204   # pytorch-labs/gpt-fast, "Fix Llama3 HF checkpoint converter (#202)"
GPT_FAST_FILES="generate.py model.py tokenizer.py LICENSE"
DEFAULT_CKPT=checkpoints/SmolLM2-135M-Instruct
PARTS=tests,small,large
DRY=0
FETCH=""

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --parts) PARTS=$2; shift ;;
        --fetch) FETCH=https://github.com/pytorch-labs/gpt-fast
                 if [ $# -gt 1 ] && [[ $2 != --* ]]; then FETCH=$2; shift; fi ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

fetch() {   # gpt-fast at the pinned commit and the default checkpoint's config/tokenizer, into $GPU_DIR
    local tmp
    tmp=$(mktemp -d)
    git clone -q "$FETCH" "$tmp/gpt-fast" || { echo "cannot clone $FETCH" >&2; return 1; }
    git -C "$tmp/gpt-fast" checkout -q "$GPT_FAST_COMMIT" || { echo "no commit $GPT_FAST_COMMIT in $FETCH" >&2; return 1; }
    mkdir -p "$GPU_DIR/gpt-fast" "$GPU_DIR/smollm2"
    for f in $GPT_FAST_FILES; do cp "$tmp/gpt-fast/$f" "$GPU_DIR/gpt-fast/$f"; done
    git -C "$tmp/gpt-fast" rev-parse HEAD > "$GPU_DIR/gpt-fast/COMMIT"
    rm -rf "$tmp"
    for f in config.json tokenizer.json tokenizer_config.json; do
        cp "$DEFAULT_CKPT/$f" "$GPU_DIR/smollm2/$f" || { echo "no $DEFAULT_CKPT/$f: run make model first" >&2; return 1; }
    done
    echo "filled $GPU_DIR/ (gpt-fast $(cat "$GPU_DIR/gpt-fast/COMMIT"), $DEFAULT_CKPT's config and tokenizer)"
}

if [ -n "$FETCH" ]; then fetch; exit $?; fi

missing=0
for f in gpt-fast/generate.py gpt-fast/model.py gpt-fast/tokenizer.py smollm2/config.json smollm2/tokenizer.json; do
    [ -f "$GPU_DIR/$f" ] || { echo "missing $GPU_DIR/$f: run 'bash scripts/gpu_check.sh --fetch' here first" >&2; missing=1; }
done
[ $missing = 0 ] || exit 2

RESULTS=results
STATUS=()
step() {    # step NAME SECONDS CMD...: run it (or print it in a dry run), record its exit status
    local name=$1 limit=$2; shift 2
    echo "== $name: $*"
    if [ $DRY = 1 ]; then return 0; fi
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    STATUS+=("$name rc=$rc $((SECONDS - t0))s")
    [ -n "${OUT:-}" ] && cp "$RESULTS"/gpu_*.json "$OUT"/ 2>/dev/null
    return 0
}
has() { [[ ",$PARTS," == *",$1,"* ]]; }

if [ $DRY = 1 ]; then       # what runs before the first CUDA call
    $PY -c "import torch, transformers, safetensors; print('torch', torch.__version__, '| transformers', transformers.__version__)" || exit 1
    $PY -m pytest -q --collect-only -m "gpu and not model" tests/test_gpu.py | tail -1 || exit 1
    for c in "$GPU_DIR/smollm2/config.json" data/configs/llama-3.1-8b/config.json; do
        $PY scripts/gpu_peers.py --config "$c" --gpt-fast "$GPU_DIR/gpt-fast" --dry-run || exit 1
    done
fi

export KVC_CPU_KERNELS=0 PYTHONUNBUFFERED=1
SMALL=/tmp/gpu_check/smollm2-random LARGE=/tmp/gpu_check/llama-3.1-8b-random
BENCH="$PY scripts/benchmark.py --device cuda --dtype bfloat16 --decode-steps 64 --repeats 2"
PEERS="$PY scripts/gpu_peers.py --gpt-fast $GPU_DIR/gpt-fast --steps 64"
[ $DRY = 1 ] || rm -rf /tmp/gpu_check

if has tests; then
    step tests 300 $PY -m pytest -q -x -m "gpu and not model" tests/test_gpu.py --junitxml="$RESULTS/gpu_tests.xml"
fi
if has small; then
    step small-checkpoint 120 $PY scripts/random_checkpoint.py --like "$GPU_DIR/smollm2" --dtype bfloat16 --device cuda --out $SMALL
    step small-ours 400 $BENCH --checkpoint $SMALL --policies full --batch-sizes 1 --context-lengths 4096 --compile both \
        --json "$RESULTS/gpu_small.json"
    step small-peers 400 $PEERS --config "$GPU_DIR/smollm2/config.json" --batch 1 --context 4096 --json "$RESULTS/gpu_peers_small.json"
fi
if has large || has policies || has table3 || has kivi; then
    step large-checkpoint 300 $PY scripts/random_checkpoint.py --like data/configs/llama-3.1-8b --tokenizer "$GPU_DIR/smollm2" \
        --dtype bfloat16 --device cuda --out $LARGE
fi
if has large; then
    step large-ours 500 $BENCH --checkpoint $LARGE --policies full --batch-sizes 1 --context-lengths 4096 --compile on \
        --json "$RESULTS/gpu_large.json"
    step large-peers 500 $PEERS --config data/configs/llama-3.1-8b/config.json --batch 1 --context 4096 \
        --json "$RESULTS/gpu_peers_large.json"
fi
if has policies; then
    step policies 600 $BENCH --checkpoint $LARGE --policies 'full; ds; hshare:ratios=1/2-1/2-1/2' --batch-sizes 16 \
        --context-lengths 4096 --compile on --speedup-vs full --json "$RESULTS/gpu_policies.json"
fi
if has table3; then
    step table3-full 600 $BENCH --checkpoint $LARGE --policies full --batch-sizes 8 --context-lengths 256 \
        --decode-steps 1024 --repeats 1 --compile on --json "$RESULTS/gpu_table3_full.json"
    step table3-compressed 600 $BENCH --checkpoint $LARGE --policies 'd2o:budget=256; snapkv:budget=256' \
        --batch-sizes 32 --context-lengths 256 --decode-steps 1024 --repeats 1 --compile on \
        --json "$RESULTS/gpu_table3_compressed.json"
fi
if has kivi; then
    step kivi 600 $BENCH --checkpoint $LARGE --policies full --kv-bits 16,4 --batch-sizes 16 --context-lengths 32768 \
        --repeats 1 --compile on --json "$RESULTS/gpu_kivi.json"
fi

if [ $DRY = 1 ]; then echo "dry run: stopped before the first CUDA call"; exit 0; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/# GPU: /'
printf '# %s\n' "${STATUS[@]}"
$PY scripts/gpu_peers.py --summary "$RESULTS"/gpu_*.json
