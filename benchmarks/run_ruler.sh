#!/usr/bin/env bash
# BENCHMARKS.md "RULER grid wall time, batched decoding": RULER's 11 synthetic subtasks at 4096 tokens on the default
# model, n 20 per subtask, dense and Adamas at 128 keys, decoded 8 prompts at a time, then one at a time.
set -euo pipefail
usage="usage: $(basename "$0") [OUT_DIR] [FLAG...]
  OUT_DIR  folder for the JSON (default: the folder of this script)
  FLAG...  appended to every sparsekv command; a flag given again overrides the table's
           (smoke run on the CPU: --model tiny-random --seq 1200 --n 1 --subtasks niah_single_1,vt --device cpu)
  env: SPARSEKV (default: sparsekv), TAG device tag in the file names (default: h100)"
. "$(dirname "$0")/common.sh"

for bs in 8 1; do
    $sk eval --task ruler --seq 4096 --n 20 --method dense,adamas --budget 128 --batch "$bs" --device cuda \
        --json "$out/ruler-4k-smollm2-$tag-batch$bs.json" "$@"
done
