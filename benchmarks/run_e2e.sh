#!/usr/bin/env bash
# BENCHMARKS.md "Whole-model decode speed": a random-weight Llama-3-8B decoding 32 tokens per method after a shared
# prefill, at 32768 tokens (batch 1 and 8), then 131072 and 262144 (batch 1, chunked prefill); Spotlight and SAAP
# with untrained stand-ins. Needs a CUDA GPU with about 50 GB of memory.
set -euo pipefail
usage="usage: $(basename "$0") [OUT_DIR] [FLAG...]
  OUT_DIR  folder for the JSON (default: the folder of this script)
  FLAG...  appended to every sparsekv command; a flag given again overrides the table's
           (smoke run on the CPU: --shape smollm2-135m --seq 512 --batch 1 --new-tokens 4 --no-require-gpu)
  env: SPARSEKV (default: sparsekv), TAG device tag in the file names (default: h100)"
. "$(dirname "$0")/common.sh"
methods=dense,streaming,oracle,quest,lsh,adamas,spotlight,saap

$sk bench --e2e --require-gpu --shape llama3-8b --seq 32768 --batch 1,8 --method "$methods" --budget 2048 \
    --new-tokens 32 --json "$out/e2e-$tag-llama3-8b-32k.json" "$@"
$sk bench --e2e --require-gpu --shape llama3-8b --seq 131072 --method "$methods" --budget 2048 \
    --new-tokens 32 --prefill-chunk 16384 --json "$out/e2e-$tag-llama3-8b-131k.json" "$@"
$sk bench --e2e --require-gpu --shape llama3-8b --seq 262144 --method "$methods" --budget 2048 \
    --new-tokens 32 --prefill-chunk 16384 --json "$out/e2e-$tag-llama3-8b-long.json" "$@"
