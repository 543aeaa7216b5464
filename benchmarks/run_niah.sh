#!/usr/bin/env bash
# BENCHMARKS.md "RULER NIAH on the default model, by budget": fits Adamas' thresholds on a CPU dump of 8192 tokens of
# Debian's jargon file, then RULER NIAH at 4096 and 8192 tokens with dense, the oracle, StreamingLLM and Adamas (L1 and
# --distance ip) at budgets 16-256 (prompt seed 42), then --distance ip and the exact top-k per query head on more
# prompt sets, and passkey. One JSON per eval command, named below. A CUDA GPU makes it practical (dozens of grids).
set -euo pipefail
usage="usage: $(basename "$0") [OUT_DIR] [FLAG...]
  OUT_DIR  folder for the JSON (default: the folder of this script)
  FLAG...  appended to every sparsekv eval command; a flag given again overrides the table's
           (smoke run on the CPU: --seq 1200 --n 1 --device cpu, with MODEL=tiny-random DUMP_TOKENS=4096)
  env: SPARSEKV (default: sparsekv), TAG device tag in the file names (default: h100),
       MODEL (default: smollm2-135m), HAYSTACK essay text (default: Debian's jargon file, package jargon-text),
       DUMP_TOKENS tokens dumped for calibrate (default: 8192), WORK folder for the dump and the artifacts
       (default: a new temporary folder), PARTS what to run (default: 'budgets seeds passkey')"
. "$(dirname "$0")/common.sh"
model="${MODEL:-smollm2-135m}"
hay="${HAYSTACK:-/usr/share/doc/jargon-text/jargon.txt.gz}"
parts="${PARTS:-budgets seeds passkey}"
need_text "$hay" HAYSTACK
work_folder

# the artifacts: thresholds per (layer, KV head); "fitted" with the queries' own set, "one set" shared
$sk dump --model "$model" --text-file "$hay" --tokens "${DUMP_TOKENS:-8192}" --seq 2048 --device cpu \
    --out "$work/acts/v1"
$sk calibrate --acts "$work/acts/v1" --out "$work/fitted" --device cpu
$sk calibrate --acts "$work/acts/v1" --out "$work/one-set" --query-scales 1 --device cpu
fitted=$(echo "$work"/fitted/*/adamas/v1)
one_set=$(echo "$work"/one-set/*/adamas/v1)

ev() {  # ev NAME FLAG...: one RULER NIAH grid into niah-NAME-smollm2-<tag>.json
    local name="$1"; shift
    $sk eval --model "$model" --task ruler --subtasks niah --dense-layers 0,1 --haystack-file "$hay" --device cuda \
        "$@" --json "$out/niah-$name-smollm2-$tag.json" ${extra[@]+"${extra[@]}"}
}
extra=("$@")

if [[ " $parts " == *" budgets "* ]]; then
    for ctx in 4k 8k; do
        if [[ $ctx == 4k ]]; then L=(--seq 4096 --n 5); else L=(--seq 8192 --n 3); fi
        ev "$ctx-dense-oracle-streaming" "${L[@]}" --seed 42 --method dense,oracle,streaming --budget 64,128
        ev "$ctx-adamas-l1" "${L[@]}" --seed 42 --method adamas --artifact "$fitted" --budget 16,32,64,128,256
        ev "$ctx-adamas-l1-one-set" "${L[@]}" --seed 42 --method adamas --artifact "$one_set" --budget 64,128
        ev "$ctx-adamas-ip" "${L[@]}" --seed 42 --method adamas --artifact "$fitted" --distance ip \
            --budget 16,32,64,128,256
    done
fi
if [[ " $parts " == *" seeds "* ]]; then
    for s in 42 7 1; do
        ev "4k-adamas-ip-seed$s" --seq 4096 --n 5 --seed "$s" --method dense,adamas --artifact "$fitted" \
            --distance ip --budget 64,128
    done
    for s in 42 7 1 2 3 4 5; do
        n=5; [[ $s == 42 || $s == 7 ]] && n=3
        ev "8k-adamas-ip-seed$s" --seq 8192 --n "$n" --seed "$s" --method dense,adamas --artifact "$fitted" \
            --distance ip --budget 64,128,512
        ev "8k-exact-topk-seed$s" --seq 8192 --n "$n" --seed "$s" --method oracle --pooling head --window 1 \
            --budget 128,512
    done
fi
if [[ " $parts " == *" passkey "* ]]; then
    $sk eval --model "$model" --task passkey --seq 4096 --n 30 --seed 42 --dense-layers 0,1 --device cuda \
        --method dense,adamas --artifact "$fitted" --distance ip --budget 64,128 \
        --json "$out/passkey-4k-adamas-ip-smollm2-$tag.json" "$@"
fi
