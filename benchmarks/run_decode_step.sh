#!/usr/bin/env bash
# BENCHMARKS.md "Decode step of one layer" and "Top-k select": one decode step of one layer per method at
# Llama-3-8B's shape, 131072 tokens, budget 2048, against SDPA and flash-decoding (and the top-k table); then the
# top-k at 8192 tokens, budget 128. Needs a CUDA GPU.
set -euo pipefail
usage="usage: $(basename "$0") [OUT_DIR] [FLAG...]
  OUT_DIR  folder for the JSON (default: the folder of this script)
  FLAG...  appended to every sparsekv command; a flag given again overrides the table's
           (smoke run on the CPU: --shape smollm2-135m --seq 512 --budget 64 --no-require-gpu)
  env: SPARSEKV (default: sparsekv), TAG device tag in the file names (default: h100)"
. "$(dirname "$0")/common.sh"

step() {  # step NAME FLAG...: one bench run at 131072 tokens, budget 2048, into step-<tag>-llama3-8b-131k-NAME.json
    local name="$1"; shift
    $sk bench --require-gpu --seq 131072 --shape llama3-8b --budget 2048 "$@" \
        --json "$out/step-$tag-llama3-8b-131k-$name.json" ${extra[@]+"${extra[@]}"}
}
extra=("$@")
step oracle-quest --method dense,oracle,quest
step methods-group --method dense,oracle,streaming,adamas,quest,lsh --pooling group
step adamas-lsh-group --method dense,adamas,lsh --pooling group --no-topk
step adamas --method dense,adamas
step adamas-ip-group --method dense,adamas --distance ip --pooling group --no-topk
step adamas-ip-head --method dense,adamas --distance ip --pooling head --no-topk
step adamas-ip-rerank4 --method dense,adamas --distance ip --pooling head --rerank 4 --no-topk
step methods --method flashdecode,oracle,streaming,quest,lsh,adamas,spotlight,saap --no-topk
step adamas-group --method flashdecode,adamas --pooling group --no-topk
$sk bench --require-gpu --seq 8192 --shape llama3-8b --method dense,oracle,quest,adamas --distance ip --budget 128 \
    --json "$out/step-$tag-llama3-8b-8k-b128.json" "$@"
