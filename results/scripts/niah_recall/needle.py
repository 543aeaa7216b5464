"""Needle-value capture at the answer position: for each prompt, the query at its last prompt token (the one that
predicts the first answer token); per layer, the share of dense attention mass on the needle-value tokens that each
method's attended set keeps (summed over query heads), and the share of (query head) rows whose attended set has
every value token of at least one needle.

usage (in the folder where gen.py and build.py wrote niah.txt and niah-meta.json):
    python needle.py DUMP ARTIFACT OUT.json
DUMP: `sparsekv dump --text-file niah.txt --seq-len 4096 --tokens 32768 --queries 4096 --out DUMP`; ARTIFACT: an
Adamas artifact version folder (results/artifacts/smollm2-135m-instruct-q4_1/adamas/v1)."""
import json, sys, torch
from sparsekv.activations import load_activations
from sparsekv.eval.recall import _attended, _bind, DumpModel
from sparsekv.methods import CacheShape, get_method
from sparsekv.models import load_model
tok = load_model("smollm2-135m", quiet=True).tokenizer
meta = json.load(open("niah-meta.json"))
ids = tok.encode(open("niah.txt").read(), add_special_tokens=False)
DUMP, ART, OUT = sys.argv[1:4]
acts = load_activations(DUMP)
target = DumpModel.from_dump(acts)
specs = [(f"{m}@{b}", (lambda m=m, b=b: get_method(m, budget=b, **({"artifact": ART} if m == "adamas" else {}))))
         for b in (64, 128) for m in ("oracle", "adamas", "streaming")]
# needle value token positions per prompt
needles, qp = [], []
for i, m in enumerate(meta):
    seq = ids[i*4096:(i+1)*4096]
    pieces = [tok.decode([x], skip_special_tokens=False) for x in seq]
    starts, c = [], 0
    for p in pieces: starts.append(c); c += len(p)
    text = "".join(pieces); p_last = m["prompt_tokens"] - 1
    pos = []
    for v in m["answer"]:
        k = text.find(" is: " + v)  # the needle sentence, not the appended answer
        assert k >= 0 and k < starts[p_last], (m["subtask"], v)
        a, b = k + 5, k + 5 + len(v)
        pos.append([t for t in range(len(starts)) if starts[t] < b and starts[t] + len(pieces[t]) > a])
    needles.append(pos); qp.append(p_last)
    print(m["subtask"], "query", p_last, "needle tokens", [(q[0], len(q)) for q in pos])
L, Hkv, Hq, D = acts.num_layers, acts.kv_heads, acts.q_heads, acts.head_dim
G = Hq // Hkv
P = acts.positions()
res = {name: {"cap": [0.0]*L, "tot": [0.0]*L, "full": [0]*L, "rows": [0]*L} for name, _ in specs}
for layer in range(L):
    data = acts.layer(layer)
    for s in range(8):
        p = qp[s]; end = p + 1
        row = int(torch.nonzero((P["q_seq"] == s) & (P["q_pos"] == p))[0])
        keys = data["k_post"][:, s*4096:s*4096+end].float().unsqueeze(0)
        q = data["q_post"][:, row].float().view(1, Hq, 1, D)
        probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q.view(Hkv, G, D), keys[0]).reshape(Hq, end).double() * D**-0.5, -1)
        allpos = [t for nd in needles[s] for t in nd]
        for name, mk in specs:
            m = mk(); _bind(m, target)
            st = m.new_state(layer, CacheShape(1, Hkv, Hq, D, 4096, torch.float32, torch.device("cpu")))
            kb = torch.zeros(1, Hkv, 4096, D); kb[:, :, :end] = keys; vb = torch.zeros_like(kb)
            st.keys, st.values, st.length = kb, vb, end
            m.append(st, kb[:, :, :end], vb[:, :, :end], None, 0)
            mask = _attended(m.select(st, q, None), Hkv, Hq, end, torch.device("cpu"))
            mask = mask if mask.shape[0] == Hq else mask.repeat_interleave(G, 0)
            r = res[name]
            r["cap"][layer] += float((probs[:, allpos] * mask[:, allpos]).sum())
            r["tot"][layer] += float(probs[:, allpos].sum())
            r["full"][layer] += int(sum(any(bool(mask[h, nd].all()) for nd in needles[s]) for h in range(Hq)))
            r["rows"][layer] += Hq
out = {}
for name, r in res.items():
    cap = sum(r["cap"]) / sum(r["tot"]); full = sum(r["full"]) / sum(r["rows"])
    per = [round(c / t, 3) for c, t in zip(r["cap"], r["tot"])]
    out[name] = {"needle_mass_captured": cap, "rows_with_a_whole_needle_value": full, "per_layer_captured": per}
    print(name, f"needle-mass captured {cap:.3f}  rows with a whole needle value {full:.3f}")
dense = [round(t / 8, 3) for t in res["oracle@64"]["tot"]]
out["dense_mass_on_needle_values_per_layer"] = dense  # summed over the query heads, mean over the 8 prompts
print("dense mass on needle values per layer (sum over 9 q heads, mean over 8 prompts):", dense)
for name, r in out.items():
    if name in res: print(name, r["per_layer_captured"])
json.dump(out, open(OUT, "w"), indent=1)
