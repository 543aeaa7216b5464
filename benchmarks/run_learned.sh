#!/usr/bin/env bash
# BENCHMARKS.md "Spotlight and SAAP on the default model" and "Speed of Spotlight and SAAP": Debian's jargon file cut
# into a training part (its first 70 %, at a paragraph break) and a held-out part; train-hash and index on a dump of
# the training part; then IoU on a dump of the held-out part, RULER NIAH (held-out part as the haystack), passkey and
# perplexity on the default model, and the per-layer and whole-model speed at Llama-3-8B's shape. Needs a CUDA GPU
# (and faiss-cpu for index); the held-out recall runs on the CPU.
set -euo pipefail
usage="usage: $(basename "$0") [OUT_DIR] [FLAG...]
  OUT_DIR  folder for the JSON (default: the folder of this script)
  FLAG...  appended to the eval commands
  env: SPARSEKV (default: sparsekv), TAG device tag in the file names (default: h100),
       TEXT natural text (default: Debian's jargon file, package jargon-text),
       WORK folder for the texts, dumps and artifacts (default: a new temporary folder),
       PARTS what to run (default: 'spotlight saap speed')"
. "$(dirname "$0")/common.sh"
text="${TEXT:-/usr/share/doc/jargon-text/jargon.txt.gz}"
parts="${PARTS:-spotlight saap speed}"
need_text "$text" TEXT
work_folder

python3 - "$text" "$work" <<'PY'
import gzip, sys
src, work = sys.argv[1], sys.argv[2]
t = (gzip.open if src.endswith(".gz") else open)(src, "rt", encoding="utf-8", errors="replace").read()
cut = t.index("\n\n", int(len(t) * 0.7))
open(f"{work}/train.txt", "w").write(t[:cut])
open(f"{work}/heldout.txt", "w").write(t[cut:])
PY
niah=(--task ruler --subtasks niah --seq 4096,8192 --n 13 --haystack-file "$work/heldout.txt" --batch 8)

if [[ " $parts " == *" spotlight "* ]]; then
    $sk dump --text-file "$work/train.txt" --tokens 262144 --seq 8192 --queries 1024 --out "$work/acts"
    $sk train-hash --acts "$work/acts" --out "$work/art" --json "$out/train-hash-smollm2-jargon-$tag.json"
    spot=$(echo "$work"/art/*/spotlight/v1)
    $sk dump --text-file "$work/heldout.txt" --tokens 16384 --seq 8192 --queries 32 --device cpu --out "$work/held"
    $sk eval --task recall --acts "$work/held" --method oracle,lsh,spotlight --artifact "$spot" --budget 0.02 \
        --dense-layers 0,1 --device cpu --json "$out/recall-spotlight-smollm2-jargon-heldout-cpu.json"
    $sk eval "${niah[@]}" --method dense,oracle,spotlight --artifact "$spot" --budget 0.02 --dense-layers 0,1 \
        --json "$out/niah-spotlight-smollm2-$tag.json" "$@"
    # "Spotlight at 2 %, 520 prompts a cell": 65 prompts per subtask (the later --n wins), another prompt set
    $sk eval "${niah[@]}" --n 65 --seed 1 --method dense,oracle,spotlight --artifact "$spot" --budget 0.02 \
        --dense-layers 0,1 --json "$out/niah-spotlight-520-smollm2-$tag.json" "$@"
    # "Each query head's nearest keys": the same prompts with --head-top 2 and 4, and the held-out recall of each
    for m in 2 4; do
        $sk eval "${niah[@]}" --n 65 --seed 1 --method spotlight --head-top $m --artifact "$spot" --budget 0.02 \
            --dense-layers 0,1 --json "$out/niah-spotlight-520-headtop$m-smollm2-$tag.json" "$@"
    done
    for m in 0 2 4; do
        $sk eval --task recall --acts "$work/held" --method spotlight --head-top $m --artifact "$spot" --budget 0.02 \
            --dense-layers 0,1 --device cpu --json "$out/recall-spotlight-headtop$m-smollm2-jargon-heldout-cpu.json"
    done
    # "Ternary queries": the held-out recall with binary queries, and lsh at 64 bits and with ternary queries
    $sk eval --task recall --acts "$work/held" --method spotlight --query-margin 0 --artifact "$spot" --budget 0.02 \
        --dense-layers 0,1 --device cpu --json "$out/recall-spotlight-binary-smollm2-jargon-heldout-cpu.json"
    $sk eval --task recall --acts "$work/held" --method lsh --nbits 64 --budget 0.02 --dense-layers 0,1 --device cpu \
        --json "$out/recall-lsh-64bit-smollm2-jargon-heldout-cpu.json"
    $sk eval --task recall --acts "$work/held" --method lsh --query-margin 0.35 --budget 0.02 --dense-layers 0,1 \
        --device cpu --json "$out/recall-lsh-ternary-smollm2-jargon-heldout-cpu.json"
    $sk eval --task passkey --seq 4096,8192 --n 100 --batch 8 --method dense,oracle,spotlight --artifact "$spot" \
        --budget 0.02 --dense-layers 0,1 --json "$out/passkey-spotlight-smollm2-$tag.json" "$@"
    $sk eval --task ppl --text-file "$work/heldout.txt" --seq 4096 --n 4 --method dense,oracle,spotlight \
        --artifact "$spot" --budget 0.02 --dense-layers 0,1 --json "$out/ppl-spotlight-smollm2-$tag.json" "$@"
    $sk eval --task ppl --text-file "$work/heldout.txt" --seq 4096 --n 4 --method dense,oracle,spotlight \
        --artifact "$spot" --budget 0.05,0.1,0.2 --dense-layers 0,1 \
        --json "$out/ppl-budgets-spotlight-smollm2-$tag.json" "$@"
fi
if [[ " $parts " == *" saap "* ]]; then
    $sk dump --text-file "$work/train.txt" --tokens 65536 --seq 8192 --queries 1024 --out "$work/acts1k"
    fit=(--acts "$work/acts1k" --gap 64 --min-range 32 --iters 1200 --eval-every 400 --patience 0)
    $sk index "${fit[@]}" --out "$work/qm" --no-causal --json "$out/index-saap-smollm2-jargon-$tag.json"
    $sk index "${fit[@]}" --out "$work/qmc" --json "$out/index-saap-causal-smollm2-jargon-$tag.json"
    $sk index --acts "$work/acts1k" --out "$work/km" --no-query-model \
        --json "$out/index-saap-kmeans-smollm2-jargon-$tag.json"
    small=(--budget 0.06 --sink 1 --window 63 --dense-layers 0)
    $sk eval "${niah[@]}" --method oracle "${small[@]}" --json "$work/niah-oracle.json" "$@"
    $sk eval "${niah[@]}" --method saap --artifact "$(echo "$work"/qm/*/saap/v1)" "${small[@]}" --cap-keep oldest \
        --json "$work/niah-saap.json" "$@"
    $sk eval "${niah[@]}" --method saap --artifact "$(echo "$work"/km/*/saap/v1)" "${small[@]}" --cap-keep oldest \
        --json "$work/niah-saap-kmeans.json" "$@"
    $sk eval "${niah[@]}" --method saap --artifact "$(echo "$work"/qmc/*/saap/v1)" "${small[@]}" \
        --json "$work/niah-saap-causal.json" "$@"
    # one file, the oracle first: the same prompts, so the saap cells get paired differences to it
    python3 - "$out/niah-saap-smollm2-$tag.json" "$work"/niah-{oracle,saap,saap-kmeans,saap-causal}.json <<'PY'
import json, sys
from sparsekv.eval.intervals import annotate
rows = [r for f in sys.argv[2:] for r in (lambda d: d if isinstance(d, list) else [d])(json.load(open(f)))]
json.dump(annotate(rows), open(sys.argv[1], "w"), indent=1)
PY
    # twice the tokens: the default fit (early stopping) and the paper's 40000 iterations; NIAH of both and of the
    # centroids alone (the oracle's prompts: the same command)
    $sk dump --text-file "$work/train.txt" --tokens 131072 --seq 8192 --queries 1024 --out "$work/acts128k"
    # --min-delta 0 here and in the sweep: these tables' fits ran until two evaluations without any lower KL
    $sk index --acts "$work/acts128k" --gap 64 --min-range 32 --min-delta 0 --out "$work/def" \
        --json "$out/index-saap-causal-default-$tag.json"
    $sk index --acts "$work/acts128k" --gap 64 --min-range 32 --iters 40000 --eval-every 5000 --patience 0 \
        --checkpoint-every 2000 --out "$work/q40k" --json "$out/index-saap-causal-40k-$tag.json"
    $sk eval "${niah[@]}" --method saap --artifact "$(echo "$work"/def/*/saap/v1)" "${small[@]}" \
        --json "$out/niah-saap-causal-default-smollm2-$tag.json" "$@"
    $sk eval "${niah[@]}" --method saap --artifact "$(echo "$work"/q40k/*/saap/v1)" "${small[@]}" \
        --json "$out/niah-saap-causal-40k-smollm2-$tag.json" "$@"
    $sk eval "${niah[@]}" --method saap --artifact "$(echo "$work"/q40k/*/saap/v1)" "${small[@]}" --no-query-model \
        --json "$out/niah-saap-kmeans-128k-smollm2-$tag.json" "$@"
    # ℓ from 8 to 64 beside the oracle and Adamas at 2-6 %, and the score-vs-selectivity plot (a fresh default fit)
    $sk index --acts "$work/acts128k" --gap 64 --min-range 32 --min-delta 0 --out "$work/sweep" \
        --json "$out/index-saap-causal-sweep-$tag.json"
    for L in 8 16 32 64; do
        $sk eval "${niah[@]}" --method saap --artifact "$(echo "$work"/sweep/*/saap/v1)" "${small[@]}" --probes $L \
            --json "$out/niah-saap-l$L-smollm2-$tag.json" "$@"
    done
    $sk eval "${niah[@]}" --method dense,oracle,adamas --budget 0.02,0.03,0.045,0.06 --sink 1 --window 63 \
        --dense-layers 0 --json "$out/niah-budgets-smollm2-$tag.json" "$@"
    # each SAAP cell's paired difference to dense and to the oracle at 6 % (the same prompts in both runs)
    python3 - "$out/niah-budgets-smollm2-$tag.json" "$out"/niah-saap-l{8,16,32,64}-smollm2-$tag.json <<'PY'
import json, sys
from sparsekv.eval.intervals import difference
base = json.load(open(sys.argv[1]))
for f in sys.argv[2:]:
    rows = json.load(open(f))
    for r in rows:
        for name, budget in (("dense", None), ("oracle", 0.06)):
            b = next(x for x in base if x["method"] == name and x["seq_len"] == r["seq_len"] and x["budget"] == budget)
            r[f"vs_{name}"] = difference(r["samples"], b["samples"])
    json.dump(rows, open(f, "w"), indent=1)
PY
    plotted=("$out"/niah-saap-l{8,16,32,64}-smollm2-$tag.json "$out/niah-budgets-smollm2-$tag.json")
    spot=$(echo "$work"/art/*/spotlight/v1)
    if [[ -d "$spot" ]]; then  # Spotlight beside them when its part ran: the same prompts, budgets and dense part
        $sk eval "${niah[@]}" --method spotlight --artifact "$spot" --budget 0.02,0.03,0.045,0.06 --sink 1 \
            --window 63 --dense-layers 0 --json "$out/niah-spotlight-budgets-smollm2-$tag.json" "$@"
        plotted+=("$out/niah-spotlight-budgets-smollm2-$tag.json")
    fi
    $sk plot "${plotted[@]}" --x selectivity -o "$out/niah-saap-selectivity-smollm2-$tag.png"
    # "Stopping at the plateau": the 7500 iterations whose weights the default (--min-delta 0.02) keeps, and NIAH
    # at 4096 with them, both poolings, annotated against the budgets run's dense and oracle cells
    $sk index --acts "$work/acts128k" --gap 64 --min-range 32 --iters 7500 --eval-every 2500 --out "$work/q7500" \
        --json "$out/index-saap-causal-7500-$tag.json"
    for pool in group head; do
        $sk eval "${niah[@]}" --seq 4096 --method saap --artifact "$(echo "$work"/q7500/*/saap/v1)" "${small[@]}" \
            --probes 64 --pooling $pool --json "$work/niah-7500-$pool.json" "$@"
    done
    python3 - "$out/niah-saap-l64-7500-smollm2-$tag.json" "$out/niah-budgets-smollm2-$tag.json" \
        "$work"/niah-7500-{group,head}.json <<'PY'
import json, sys
from sparsekv.eval.intervals import annotate
base = [r for r in json.load(open(sys.argv[2])) if r["seq_len"] == 4096 and r["method"] in ("dense", "oracle")
        and r["budget"] in (None, 0.06)]
json.dump(annotate(base + [json.load(open(f)) for f in sys.argv[3:]]), open(sys.argv[1], "w"), indent=1)
PY
fi
if [[ " $parts " == *" speed "* ]]; then
    $sk bench --require-gpu --seq 131072 --shape llama3-8b --method dense,lsh,spotlight --budget 2048 \
        --json "$out/step-$tag-llama3-8b-131k-spotlight.json"
    $sk bench --require-gpu --seq 1048576 --shape one-head --method spotlight,lsh --budget 0.02 \
        --json "$out/step-$tag-one-head-1m-spotlight.json"
    $sk bench --require-gpu --seq 131072 --shape llama3-8b --method flashdecode,saap --budget 6554 --no-topk \
        --json "$out/step-$tag-llama3-8b-131k-saap.json"
    $sk bench --e2e --require-gpu --shape llama3-8b --seq 131072 --method dense,lsh,spotlight --budget 2048 \
        --new-tokens 32 --prefill-chunk 16384 --json "$out/e2e-$tag-llama3-8b-131k-spotlight.json"
    $sk bench --e2e --require-gpu --shape llama3-8b --seq 131072 --method dense,streaming,lsh,saap --budget 6554 \
        --new-tokens 32 --prefill-chunk 16384 --json "$out/e2e-$tag-llama3-8b-131k-saap.json"
    for m in 0 4; do  # "Each query head's nearest keys": what --head-top costs
        $sk bench --require-gpu --seq 131072 --shape llama3-8b --method flashdecode,spotlight --budget 2048 \
            --head-top $m --json "$out/step-$tag-llama3-8b-131k-spotlight-headtop$m.json"
        $sk bench --e2e --require-gpu --shape llama3-8b --seq 131072 --method dense,spotlight --budget 2048 \
            --head-top $m --new-tokens 32 --prefill-chunk 16384 \
            --json "$out/e2e-$tag-llama3-8b-131k-spotlight-headtop$m.json"
    done
fi
