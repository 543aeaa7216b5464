"""Eval grids on the GPU from a plan: python results/scripts/eval_plan.py PLAN.json OUTDIR DEADLINE_EPOCH

PLAN: list of groups {"name", "task", "seq", "n", "subtasks"?, "specs": [{"label", "method", "budget", "options"}]}.
Each group runs with one run_grid (shared prefill), results saved after every prompt to OUTDIR/<name>.json.
Groups are skipped once the deadline is passed. The essay haystack: $HAYSTACK, else Debian's jargon file.
results/adamas-sink-window-smollm2-h100.json holds its outputs, each with the plan group that made it."""
import json, os, sys, time
from pathlib import Path

import torch

from sparsekv.models import load_model
from sparsekv.eval.runner import RunSpec, run_grid

plan = json.load(open(sys.argv[1]))
out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
deadline = float(sys.argv[3])
HAY = os.environ.get("HAYSTACK", "/usr/share/doc/jargon-text/jargon.txt.gz")
t0 = time.time()
lm = load_model("smollm2-135m", device="cuda", dtype=torch.bfloat16, quiet=True)
print(f"model loaded {time.time() - t0:.1f}s", flush=True)
for g in plan:
    if time.time() > deadline:
        print(f"skip {g['name']}: deadline", flush=True)
        continue
    specs = [RunSpec(s["method"], s.get("budget"), s.get("options", {})) for s in g["specs"]]
    labels = [s.get("label", s["method"]) for s in g["specs"]]
    topt = {"subtasks": g.get("subtasks", "niah"), "haystack_file": HAY} if g["task"] == "ruler" else {}
    path = out / f"{g['name']}.json"
    t1 = time.time()

    def save(build, complete=False):
        cells = build() if callable(build) else build
        for c, lab in zip(cells, labels):
            c["label"] = lab
        json.dump({"group": g, "complete": complete, "seconds": round(time.time() - t1, 1), "cells": cells},
                  open(path, "w"), indent=1)
        if time.time() > deadline + 60:
            raise SystemExit("deadline passed mid-group; partial saved")

    try:
        cells = run_grid(lm, g["task"], specs, g["seq"], g["n"], g.get("seed", 42), tuple(g.get("dense_layers", [0, 1])),
                         task_options=topt, on_partial=save)
        save(cells, True)
    except SystemExit as e:
        print(e, flush=True)
    line = " | ".join(f"{lab} {c['score']:.1f}" for lab, c in zip(labels, json.load(open(path))["cells"]))
    print(f"{g['name']} ({time.time() - t1:.0f}s): {line}", flush=True)
