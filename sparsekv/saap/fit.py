"""`sparsekv index`: SAAP's index of a model, fitted to a dump (the paper's offline stage, §4 and Appendix A).

1. Per (layer, KV head), spherical k-means of the keys into C buckets with faiss (sparsekv/saap/kmeans.py): on the
   pre-RoPE keys (§4 "Assigning with(out) RoPE": RoPE's temporal drift hurts the assignment), or with
   `space="post"` on the post-RoPE ones (the paper's "K-means (roped inputs)" baseline). Trained on the fit
   sequences' keys, the attention sink (each sequence's first `sink` keys) left out.
2. Every (layer, KV head)'s query model trained at once (sparsekv/saap/objective.py: eq. 1's KL against each
   long-range query's attention per bucket) through the shared loop (sparsekv/offline/train.py): Adam at lr 1e-5,
   constant, up to 40k iterations (Appendix A), products on TF32 tensor cores (CUDA; the attention targets stay
   fp32), checkpoints and resume. The held-out KL is measured every iters / 16 iterations; the run keeps the
   weights of its lowest and stops after `patience` (2) evaluations without one lower by `min_delta` (2 %) of it
   (`patience=0`: every iteration and the last weights, as the paper). On the default model the held-out KL
   gains 4.5 % from 5000 to 7500 iterations and then under 1.1 % an evaluation, with the hit rate and mass in the
   third decimal (benchmarks/BENCHMARKS.md, "SAAP: stopping at the plateau"). The paper's 40k iterations draw on
   40 prompts of 500k tokens; a dump of a few hundred thousand tokens is learnt by heart long before (its held-out
   KL rises while the training loss keeps falling). `query_model=False` skips the model (the "K-means" baselines:
   queries ranked by the centroids). The targets pair each query with earlier keys only (`causal`, default True;
   the paper's two-way pairs with causal=False: objective.py says why and what it costs).
3. The report (on causal pairs, whatever the training pairs: what a decode step can read): bucket sizes of
   held-out keys (histogram, imbalance factor), and on held-out long-range queries the
   Q-model's KL and, at ℓ probes, the share of queries whose heaviest long-range key is in a visited bucket and the
   share of their long-range attention the visited buckets hold, beside the centroid baseline's.

Scaled to the dump (the paper trains on 40 prompts of 500k tokens; a dump's sequences are far shorter): the pair
distance `gap` defaults to min(2047, seq_len // 4) and the long-range query threshold `min_range` to min(1024,
gap // 2). The paper's gap is its dense window (2047): pairs farther apart than the window are the ones the sparse
part must find. A 2048-token dump would have no such pair, so the gap keeps three quarters of each sequence as
long-range keys, with the paper's 1:2 ratio between the two thresholds; decode with a window of about the same
size as the gap the index was fitted with (the report records both).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ..activations import Activations
from ..errors import SparseKVError
from ..jsonio import device_label
from ..offline.data import DumpExamples
from ..offline.stage import check_holdout, data_record, fit_and_save, fit_layers, with_defaults
from ..offline.train import TrainConfig, train
from ..progress import Ticker
from .kmeans import clusters_for, spherical_kmeans
from .model import QueryModel, assign
from .objective import LongRange, SaapObjective, bucket_sizes

METHOD = "saap"
KMEANS = "kmeans.pt"  # beside the training checkpoint: a resumed run reuses the centroids


def default_ranges(seq_len: int) -> tuple[int, int]:
    """(gap, min_range) for a dump of `seq_len`-token sequences (module docstring)."""
    gap = max(1, min(2047, seq_len // 4))
    return gap, max(1, min(1024, gap // 2))


def check_options(**options: Any) -> TrainConfig:
    """index_keys' checks that need no dump (`index` runs them before it reads one), one SparseKVError line naming
    the option; -> the Q-model training loop's config. What depends on the dump's lengths is checked with it."""
    o = with_defaults(index_keys, options)
    if o["space"] not in ("pre", "post"):
        raise SparseKVError(f"--space must be pre or post, got {o['space']!r}")
    for name, key in (("--clusters", "clusters"), ("--kmeans-iters", "kmeans_iters"), ("--hidden", "hidden"),
                      ("--queries-per-step", "queries_per_step"), ("--heldout-queries", "heldout_queries"),
                      ("--probes", "probes")):
        if o[key] is not None and o[key] < 1:
            raise SparseKVError(f"{name} must be >= 1, got {o[key]}")
    if o["probes"] is not None and o["probes"] > o["clusters"]:
        raise SparseKVError(f"--probes {o['probes']} is more than the {o['clusters']} buckets (--clusters)")
    if o["sink"] < 0:
        raise SparseKVError(f"--sink must be >= 0, got {o['sink']}")
    if o["gap"] is not None and o["gap"] < 1:
        raise SparseKVError(f"--gap must be >= 1, got {o['gap']}")
    if o["min_range"] is not None and o["min_range"] < 0:
        raise SparseKVError(f"--min-range must be >= 0, got {o['min_range']}")
    patience = o["patience"] if o["query_model"] else 0  # nothing is trained without a Q-model
    check_holdout(o["holdout"], patience)
    cfg = TrainConfig(iters=o["iters"], lr=o["lr"], min_lr=o["lr"], warmup=0, optimizer="adam", betas=(0.9, 0.999),
                      weight_decay=0.0, clip=None, checkpoint_every=o["checkpoint_every"],
                      eval_every=o["eval_every"] or max(1, o["iters"] // 16), seed=o["seed"], tf32=True,
                      best_by="kl" if patience else "", patience=patience, min_delta=o["min_delta"])
    cfg.check()
    return cfg


def check_dump_options(acts: Activations, *, layers: Sequence[int] | None = None, gap: int | None = None,
                       min_range: int | None = None, sink: int = 1, **_: Any) -> tuple[list[int], int, int]:
    """index_keys' checks that need the dump's manifest only (its layer count and lengths; no file is read or
    hashed); -> the layers, gap and min_range the fit uses."""
    layers = fit_layers(layers, acts.num_layers)
    auto_gap, auto_min = default_ranges(max(acts.seq_lengths))
    gap, min_range = auto_gap if gap is None else gap, auto_min if min_range is None else min_range
    reach = max(acts.seq_lengths) - 1 - sink  # the farthest (query, key) pair a sequence holds, sinks left out
    if max(gap, min_range) > reach:
        raise SparseKVError(f"--gap {gap}, --min-range {min_range} and --sink {sink}: the dump's sequences of at most "
                            f"{max(acts.seq_lengths)} tokens hold no pair that far apart (at most {max(reach, 0)}); "
                            f"lower them or dump longer sequences (--seq)")
    return layers, gap, min_range


def index_keys(acts: Activations, *, layers: Sequence[int] | None = None, clusters: int = 1024,
               kmeans_iters: int = 10, space: str = "pre", query_model: bool = True, hidden: int = 1024,
               iters: int = 40000, lr: float = 1e-5, queries_per_step: int = 1000, gap: int | None = None,
               min_range: int | None = None, causal: bool = True, sink: int = 1, probes: int | None = None,
               holdout: float = 0.1, heldout_queries: int = 1000, eval_every: int = 0, patience: int = 2,
               min_delta: float = 0.02, checkpoint_every: int = 1000,
               seed: int = 0, device: str | torch.device = "cpu", work: str | Path | None = None,
               resume: bool = False, progress: Any = None) -> tuple[dict, dict, dict]:
    """Fit the index of `layers` (default: all); returns (tensors, config, report): tensors {"index": centroids
    [L, Hkv, C, D], layers [L]} and, with a Q-model, {"query_model": w1 [L, Hkv, D, M], b1 [L, Hkv, M], w2
    [L, Hkv, M, C], b2 [L, Hkv, C]} (batch norm folded into w1, b1; fp32). `work`: the checkpoint folder
    (sparsekv.offline.stage.checkpoint_dir); `resume`: continue the run saved there."""
    options = dict(locals())
    del options["acts"]
    cfg = check_options(**options)
    layers, gap, min_range = check_dump_options(acts, layers=layers, gap=gap, min_range=min_range, sink=sink)
    t0 = time.perf_counter()
    tick = Ticker(progress, len(layers), "load dump")
    data = DumpExamples(acts, layers, pre_rope=space == "pre", with_post=True, holdout=holdout, device=device,
                        progress=tick.advance)
    L, Hkv, D = len(layers), acts.kv_heads, acts.head_dim

    # 1. k-means on the fit sequences' keys, sinks left out
    rows = torch.cat([torch.arange(data.offsets[s] + sink, data.offsets[s] + data.lengths[s])
                      for s in data.fit_seqs])
    C, note = clusters_for(clusters, len(rows))
    if note and probes is not None and probes > C:
        note += f"; the held-out report visits all {C} buckets, not --probes {probes}"
    if note:
        tick.note(note)
    probes = max(1, round(C / 32)) if probes is None else min(int(probes), C)
    centroids, backend, km_seconds = _kmeans(data.k[:, :, rows.to(data.k.device)], C, kmeans_iters, seed, work,
                                             resume, progress)
    centroids = centroids.to(device)
    buckets = assign(data.k, centroids)  # [L, Hkv, T]: every dumped key's bucket

    # 2. the Q-model
    pairs = LongRange(gap, min_range, sink, causal)
    patterns = [acts.patterns()[i] for i in layers]
    obj = SaapObjective(data, patterns, buckets, C, pairs, queries_per_step, seed)
    # the report scores what a decode step can read: causal pairs, also when the model trains on two-way ones
    scored = obj if causal else SaapObjective(data, patterns, buckets, C, LongRange(gap, min_range, sink, True),
                                              queries_per_step, seed)
    held = data.held_out(heldout_queries, seed)
    config = {"clusters": C, "clusters_asked": clusters, "space": space, "query_model": query_model,
              "hidden": hidden, "layers": list(layers), "probes_reported": probes,
              "key_assignment": "argmax of inner products with unit centroids (spherical k-means)",
              "kmeans": {"iters": kmeans_iters, "backend": backend, "spherical": True, "seed": seed,
                         "init": "random (faiss)", "training_keys_per_head": len(rows)},
              "pairs": {"gap": gap, "min_range": min_range, "sink": sink, "causal": causal,
                        "defaults_from_seq_len": max(acts.seq_lengths)},
              "train": {"iters": iters, "lr": lr, "optimizer": "adam", "betas": [0.9, 0.999], "schedule": "constant",
                        "queries_per_step": queries_per_step, "seed": seed, "holdout": holdout,
                        "eval_every": cfg.eval_every, "patience": patience, "min_delta": min_delta,
                        "kept": "lowest held-out kl" if cfg.best_by else "last"}}
    model = QueryModel(L, Hkv, D, hidden, C, seed=seed).to(device) if query_model else None
    before = scored.evaluate(held, model, centroids, probes)
    report: dict[str, Any] = {"clusters": {"asked": clusters, "used": C, "note": note},
                              "kmeans": {"backend": backend, "seconds": km_seconds},
                              "heldout": {"sequences": len(held), "queries": sum(e.q.shape[2] for e in held),
                                          "from_fit_sequences": not data.held_seqs, "pairs": "causal",
                                          "long_range_share": _share(before, held)}}
    after = before
    if model is not None:
        def evaluate() -> dict:  # the report's means (each head weighted by its long-range queries)
            m = scored.evaluate(held, model, centroids, probes)
            return {k: _mean(v, m["queries"]) for k, v in m.items() if k != "queries"}

        run = train(model, lambda step: obj.loss(model, step), cfg, checkpoint_dir=work, resume=resume,
                    identity={"stage": "index", "config": config, "data": data_record(acts)}, evaluate=evaluate,
                    progress=progress, label="index", show="kl")
        report["train"] = run.report()
        after = scored.evaluate(held, model, centroids, probes)
    report["metrics"] = _metrics(layers, probes, before, after, model is not None)
    held_rows = torch.cat([torch.arange(data.offsets[s] + sink, data.offsets[s] + data.lengths[s])
                           for s in (data.held_seqs or data.fit_seqs)])
    report["buckets"] = bucket_sizes(buckets[:, :, held_rows.to(buckets.device)], C)
    report["buckets"]["from_fit_sequences"] = not data.held_seqs
    report["seconds"] = round(time.perf_counter() - t0, 2)
    report["device"] = device_label(device)
    tensors = {"index": {"centroids": centroids.float().cpu().contiguous(), "layers": torch.tensor(list(layers))}}
    if model is not None:
        tensors["query_model"] = model.folded()
    return tensors, config, report


def fit_index(acts: Activations, root: str | Path, *, resume: bool = False, version: str | None = None,
              progress: Any = None, **options: Any) -> tuple[Path, dict]:
    """index_keys from dump to artifact, method "saap" (sparsekv.offline.stage.fit_and_save: checkpoints under
    `root`, `resume`, the artifact written and the checkpoints removed). Returns (path, report)."""
    return fit_and_save(acts, root, METHOD, "index", index_keys, resume=resume, version=version, progress=progress,
                        **options)


def _kmeans(keys: torch.Tensor, clusters: int, iters: int, seed: int, work, resume: bool, progress):
    """(centroids, backend, seconds): faiss k-means, or with `resume` the centroids a previous run of the same
    command saved in its checkpoint folder."""
    path = Path(work) / KMEANS if work is not None else None
    if resume and path is not None and path.exists():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        return saved["centroids"], saved["backend"], 0.0
    t0 = time.perf_counter()
    tick = Ticker(progress, keys.shape[0] * keys.shape[1], f"k-means ({clusters} buckets)")
    centroids, backend = spherical_kmeans(keys, clusters, iters, seed, progress=tick.advance)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save({"centroids": centroids, "backend": backend}, tmp)
        tmp.replace(path)
    return centroids, backend, round(time.perf_counter() - t0, 2)


def _share(m: dict, held) -> float | None:
    """The share of held-out (layer, query head, query) triples that are long-range (they train and are scored)."""
    if not held:
        return None
    total = sum(e.q.shape[0] * e.q.shape[1] * e.q.shape[2] for e in held)
    return round(float(m["queries"].sum()) / max(total, 1), 4)


def _mean(v: torch.Tensor, queries: torch.Tensor) -> float:
    """A held-out metric per (layer, KV head) averaged over them, each weighted by its long-range queries."""
    return round(float((v * queries).sum() / queries.sum().clamp(min=1)), 4)


def _metrics(layers: Sequence[int], probes: int, before: dict, after: dict, trained: bool) -> dict:
    """Held-out metrics: means, per layer and per (layer, KV head)."""
    cols = {"hit_centroids": after["hit_centroids"], "mass_centroids": after["mass_centroids"]}
    if trained:
        cols.update(kl_before=before["kl"], kl=after["kl"], hit_before=before["hit"], hit=after["hit"],
                    mass=after["mass"])
    w = after["queries"]
    mean = lambda v, rows=slice(None): _mean(v[rows], w[rows])

    return {"probes": probes,
            "mean": {k: mean(v) for k, v in cols.items()},
            "per_layer": [{"layer": layer, **{k: mean(v, i) for k, v in cols.items()}}
                          for i, layer in enumerate(layers)],
            "per_head": {k: [[round(float(x), 4) for x in row] for row in v.tolist()] for k, v in cols.items()},
            "queries_per_head": [[int(x) for x in row] for row in w.tolist()]}
