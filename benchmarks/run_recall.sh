#!/usr/bin/env bash
# BENCHMARKS.md "Selection quality on a dump": the default model's keys and sampled queries from 2 x 1024 tokens of
# Debian's jargon file, then every method's selection at budget 64 against exact attention. CPU, under a minute.
set -euo pipefail
usage="usage: $(basename "$0") [OUT_DIR] [FLAG...]
  OUT_DIR  folder for the JSON (default: the folder of this script)
  FLAG...  appended to the sparsekv eval command; a flag given again overrides the table's
  env: SPARSEKV (default: sparsekv), MODEL (default: smollm2-135m; tiny-random for a smoke run),
       HAYSTACK text to dump (default: Debian's jargon file, package jargon-text),
       WORK folder for the dump (default: a new temporary folder)"
. "$(dirname "$0")/common.sh"
model="${MODEL:-smollm2-135m}"
text="${HAYSTACK:-/usr/share/doc/jargon-text/jargon.txt.gz}"
need_text "$text" HAYSTACK
work_folder

$sk dump --model "$model" --text-file "$text" --tokens 2048 --seq 1024 --queries 64 --device cpu \
    --out "$work/acts/v1"
$sk eval --model "$model" --task recall --acts "$work/acts/v1" --method oracle,streaming,adamas,quest,lsh \
    --budget 64 --pooling group --device cpu --json "$out/recall-smollm2-jargon2k-cpu.json" "$@"
