"""Exact top-k recall and attention mass of Adamas' key rankings on a dump: the paper's L1 code distance against the
asymmetric score q · c[code(k)] (distance "ip") with three choices of bucket centers.

    python results/scripts/adamas_ip_recall.py DUMP ARTIFACT K OUT.json

For every dumped query (position p) of layers 2.. (the first two stay dense in our runs, as in the paper), every
query head, keys [0, p] of its sequence (queries with fewer than 4K keys are skipped): the K keys each ranking picks
against the exact top-K of q·k (post-RoPE, fp32), and the softmax(q·k/sqrt(d)) mass on them. Rankings:
l1 (query codes from the artifact's query thresholds, keys' from its key thresholds; ties to the lower index),
ip_midpoints (the method's centers: kernels/reference.py::adamas_bucket_centers of the key thresholds),
ip_conditional_means (each bucket's mean of this head's dumped key values: in-sample, an upper reference),
ip_lloyd_max (thresholds and centers of a 2-bit Lloyd-Max quantizer of this head's key values, no calibration),
ip_sign (1-bit: sign of each key component). Means over (query, head), then layers."""
import json, sys, time
import torch
from sparsekv.activations import load_activations
from sparsekv.artifacts import load_artifact
from sparsekv.kernels.reference import adamas_bucket_centers, hadamard_matrix

torch.manual_seed(0)
acts = load_activations(sys.argv[1], verify=False)
art = load_artifact(sys.argv[2], method="adamas")
K = int(sys.argv[3])
T = art.tensors["thresholds"]["thresholds"].float()
QT = art.tensors["thresholds"]["query_thresholds"].float()


def code(x, t):
    return (x.unsqueeze(-1) > t).sum(-1)


t0 = time.time()
per_layer = {}
for layer in range(2, acts.num_layers):
    a = acts.layer(layer)
    kp, qp = a["k_post"].float(), a["q_post"].float()
    Hkv, _, D = kp.shape
    G = qp.shape[0] // Hkv
    H = hadamard_matrix(D, torch.float32, "cpu")
    hk, hq = kp @ H, qp @ H
    sums = {}
    for h in range(qp.shape[0]):
        g = h // G
        kc, qc = code(hk[g], T[layer, g]), code(hq[h], QT[layer, g])
        mid = adamas_bucket_centers(T[layer, g])
        cond = torch.stack([hk[g][kc == b].mean() if (kc == b).any() else mid[b] for b in range(4)])
        flat = hk[g].flatten()
        t2 = torch.quantile(flat[torch.randperm(flat.numel())[:200000]], torch.tensor([0.125, 0.5, 0.875]))
        for _ in range(20):
            c2 = code(flat, t2)
            lm = torch.stack([flat[c2 == b].mean() for b in range(4)])
            t2 = (lm[1:] + lm[:-1]) / 2
        kc2 = code(hk[g], t2)
        rank = {
            "l1": lambda qi, ks: -(qc[qi] - kc[ks]).abs().sum(-1).float(),
            "ip_midpoints": lambda qi, ks: mid[kc[ks]] @ hq[h, qi],
            "ip_conditional_means": lambda qi, ks: cond[kc[ks]] @ hq[h, qi],
            "ip_lloyd_max": lambda qi, ks: lm[kc2[ks]] @ hq[h, qi],
            "ip_sign": lambda qi, ks: torch.sign(hk[g][ks]) @ hq[h, qi],
        }
        for qi in range(qp.shape[1]):
            p = int(a["q_pos"][qi])
            ks = ((a["k_seq"] == a["q_seq"][qi]) & (a["k_pos"] <= p)).nonzero().flatten()
            if ks.numel() < 4 * K:
                continue
            s = kp[g, ks] @ qp[h, qi]
            prob = torch.softmax(s / D ** 0.5, 0)
            top = set(torch.topk(s, K).indices.tolist())
            order = torch.arange(ks.numel(), dtype=torch.float64)
            for name, f in rank.items():
                e = f(qi, ks).double()
                # ties to the lower index (as our selects): a key order far below the scores' resolution
                e = e - order * (1e-9 * (e.abs().max() + 1) / ks.numel())
                sel = torch.topk(e, K).indices
                r = sums.setdefault(name, [0.0, 0.0, 0])
                r[0] += len(top & set(sel.tolist())) / K
                r[1] += prob[sel].sum().item()
                r[2] += 1
    per_layer[layer] = {n: {"topk_recall": v[0] / v[2], "attention_mass": v[1] / v[2], "n": v[2]} for n, v in sums.items()}
    print(layer, {n: (round(v["topk_recall"], 3), round(v["attention_mass"], 3)) for n, v in per_layer[layer].items()},
          flush=True)
names = list(next(iter(per_layer.values())))
mean = {n: {m: sum(per_layer[l][n][m] for l in per_layer) / len(per_layer) for m in ("topk_recall", "attention_mass")}
        for n in names}
json.dump({"dump": str(acts.path), "dump_config": acts.config, "artifact": sys.argv[2], "k": K,
           "layers": sorted(per_layer), "mean_over_layers": mean, "per_layer": per_layer,
           "seconds": round(time.time() - t0, 1), "protocol": __doc__}, open(sys.argv[4], "w"), indent=1)
print(json.dumps(mean, indent=1))
