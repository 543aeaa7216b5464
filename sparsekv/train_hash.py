"""`train-hash`: Spotlight Attention's non-linear hash, one MLP per (layer, KV head), fitted to a dump.

The paper ("Spotlight Attention: Towards Efficient LLM Generation via Non-linear Hashing-based KV Cache Retrieval"):
- the hash (§3.2 eq. 5-6): H(x) = sign(W2 SiLU(W1 x + b1)), input the head dim, intermediate 128, 128 output bits
  ("input, intermediate, and output dimensions all set to 128", §4, for head dim 128), applied to the post-RoPE
  queries and keys attention scores; a query head uses its KV head's hash (GQA);
- similarity (eq. 3): matching bits of the query's and the key's codes (NXOR), i.e. nbits - Hamming distance; the
  keys with the most are attended;
- the loss (eq. 7-9): for each query, B = the similarities of the exact top-k keys I, C = those of the other keys
  it sees, Z_ij = B_i - C_j, L = mean over the k(n - k) pairs of -log σ(β Z_ij - α) (eq. 9 as printed drops the
  minus sign; minimising it as printed would push B below C), with sign replaced by softsign(x) = γx / (1 + γ|x|)
  while training (eq. 10). The similarity while training is the soft codes' inner product <s(q), s(k)>, which for
  ±1 codes is 2·(matching bits) - nbits: the same ranking;
- k from the pruning rate: 98 % pruned while training (k = 2 % of the keys a query sees, at least 1);
- Table 4: AdamW (0.9, 0.98), weight decay 0.1, lr 1e-3 -> 0 cosine after 81 linear warm-up steps, clipping 1.0,
  8192 iterations of one sample each; γ = 64, β = 1, α = 3; layers trained independently on precomputed
  activations, the LLM frozen.
Our choices where the paper is silent or where a dump differs:
- an iteration is one dumped sequence: a seeded sample of `queries_per_step` (64) of its dumped queries against the
  keys of that sequence each of them sees. Every (layer, KV head) trains at once as one batched model; each
  head's loss is its own mean over its queries, the heads' losses are summed and clipping is per head, so each
  head takes exactly the step it would take trained alone;
- GQA pooling "group" (default, as `lsh`): the group's query heads' similarities are summed and one top-k is taken
  per KV head, trained against the top-k of the group's summed attention probabilities (the oracle with that
  pooling); "head": every query head against its own top-k (the paper's models without GQA are this case);
- the pairwise loss: each query's k top keys against a uniform sample of `negatives` (1024) of its other keys, drawn
  afresh every step (an unbiased estimate of the mean over all k(n - k) pairs; at 8192 keys, all pairs cost ~8x
  more per step); `negatives=0` takes every pair. Computed in chunks whose backward is recomputed (no
  k x n x heads tensor is kept);
- the held-out IoU is measured every iters / 8 iterations; the run keeps the weights of its highest and stops after
  `patience` (2) evaluations without a higher one (`patience=0`: every iteration and the last weights, as the
  paper). The paper's 8192 iterations draw on 8192 sequences; a dump holds a few dozen, and on one of 32 x 8192
  tokens of the default model the held-out IoU peaks after ~2000 iterations and then falls while the training loss
  keeps falling (benchmarks/BENCHMARKS.md, "A larger dump and the best held-out weights"), as SAAP's query model
  does (`sparsekv index`);
- the training report gives IoU with the exact top-k on held-out sequences of the dump before and after training,
  per layer and head (the paper's Table 1 IoU and its Figure 10), beside the linear hash (`lsh`: angular LSH with
  the same bits, Appendix A.5) untrained and, with `linear=True`, trained with the same loss (Table 1's "Linear
  Hashing After").
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from sparsekv.kernels.reference import query_care_reference

from .activations import Activations
from .errors import SparseKVError
from .jsonio import device_label
from .offline import targets
from .offline.data import DumpExamples, Example
from .offline.stage import check_holdout, data_record, fit_and_save, fit_layers, with_defaults
from .offline.train import TrainConfig, train
from .progress import Ticker
from .selection import CODE_TIES

METHOD = "spotlight"
POOLINGS = ("group", "head")


class HashModel(nn.Module):
    """Every (layer, KV head)'s hash as one batched module: x [L, H, n, D] -> pre-sign outputs [L, H, n, nbits].
    arch "mlp": W2 SiLU(W1 x + b1) (eq. 5); "linear": x R, R initialised as angular LSH (the `lsh` method's)."""

    def __init__(self, layers: int, heads: int, d: int, hidden: int = 128, nbits: int = 128, arch: str = "mlp",
                 seed: int = 0, init_linear: torch.Tensor | None = None):
        super().__init__()
        self.arch = arch
        g = torch.Generator().manual_seed(seed)

        def uniform(*shape, fan_in):  # nn.Linear's default init, drawn from our generator
            bound = 1 / math.sqrt(fan_in)
            return nn.Parameter((torch.rand(*shape, generator=g) * 2 - 1) * bound)

        if arch == "mlp":
            self.w1, self.b1 = uniform(layers, heads, d, hidden, fan_in=d), uniform(layers, heads, hidden, fan_in=d)
            self.w2 = uniform(layers, heads, hidden, nbits, fan_in=hidden)
        elif arch == "linear":
            self.w = nn.Parameter(init_linear.clone().float())
        else:
            raise SparseKVError(f"unknown hash architecture {arch!r}: mlp or linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.arch == "linear":
            return x @ self.w
        return nn.functional.silu(x @ self.w1 + self.b1[:, :, None]) @ self.w2

    def clip_grads_(self, max_norm: float) -> None:
        """Clip each (layer, head)'s gradient to max_norm on its own, as if it were trained alone."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        sq = sum(gr.pow(2).flatten(2).sum(-1) for gr in grads)  # [L, H]
        scale = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        for gr in grads:
            gr.mul_(scale.view(*scale.shape, *([1] * (gr.ndim - 2))))


def softsign(x: torch.Tensor, gamma: float) -> torch.Tensor:
    return gamma * x / (1 + gamma * x.abs())


class _PairwiseRankLoss(torch.autograd.Function):
    """Σ over (i in B, j in C) of softplus(α - β (b_i - c_j)) per query, divided by its pair count: [L, H, nq].
    b [L, H, nq, kmax] with bmask [1, 1, nq, kmax]; c [L, H, nq, nk] with cmask [L, H, nq, nk]. Chunked over
    kmax, backward recomputed chunk by chunk (memory O(L H nq nk))."""

    CHUNK = 4

    @staticmethod
    def forward(ctx, b, c, bmask, cmask, alpha: float, beta: float):
        pairs = (bmask.sum(-1) * cmask.sum(-1)).clamp(min=1).float()
        out = torch.zeros(c.shape[:-1], dtype=torch.float32, device=c.device)
        for i in range(0, b.shape[-1], _PairwiseRankLoss.CHUNK):
            t = alpha - beta * (b[..., i : i + _PairwiseRankLoss.CHUNK, None] - c[..., None, :])
            m = bmask[..., i : i + _PairwiseRankLoss.CHUNK, None] & cmask[..., None, :]
            out += (nn.functional.softplus(t) * m).sum((-1, -2))
        ctx.save_for_backward(b, c, bmask, cmask, pairs)
        ctx.alpha, ctx.beta = alpha, beta
        return out / pairs

    @staticmethod
    def backward(ctx, grad):
        b, c, bmask, cmask, pairs = ctx.saved_tensors
        w = (grad / pairs)[..., None, None]
        gb, gc = torch.zeros_like(b), torch.zeros_like(c)
        for i in range(0, b.shape[-1], _PairwiseRankLoss.CHUNK):
            t = ctx.alpha - ctx.beta * (b[..., i : i + _PairwiseRankLoss.CHUNK, None] - c[..., None, :])
            m = bmask[..., i : i + _PairwiseRankLoss.CHUNK, None] & cmask[..., None, :]
            s = torch.sigmoid(t) * m * w  # d softplus(t) / dt, masked and weighted
            gb[..., i : i + _PairwiseRankLoss.CHUNK] = -ctx.beta * s.sum(-1)
            gc += ctx.beta * s.sum(-2)
        return gb, gc, None, None, None, None


def rank_loss(sim: torch.Tensor, truth: torch.Tensor, valid: torch.Tensor, vis: torch.Tensor, alpha: float,
              beta: float, negatives: int = 0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Eq. 7-9 per query: [L, H, nq]. sim [L, H, nq, nk] similarities, truth/valid the exact top-k (targets.topk_sets),
    vis the keys each query sees. `negatives` > 0: C is a uniform sample (without replacement, from `generator`) of
    that many of each query's other keys, an unbiased estimate of the mean over all of them at a fraction of the
    pairs; 0: every pair."""
    b = sim.gather(-1, truth)
    rest = vis & ~targets.set_mask(truth, valid, sim.shape[-1])
    if negatives and negatives < sim.shape[-1]:
        r = torch.rand(rest.shape, generator=generator, device=sim.device)
        pick = torch.topk(r.masked_fill(~rest, -1.0), negatives, dim=-1).indices  # uniform among the rest
        return _PairwiseRankLoss.apply(b, sim.gather(-1, pick), valid, rest.gather(-1, pick), alpha, beta)
    return _PairwiseRankLoss.apply(b, sim, valid, rest, alpha, beta)


class SpotlightObjective:
    """The loss of a step and the held-out IoU of a HashModel over the layers of a DumpExamples."""

    def __init__(self, data: DumpExamples, patterns, *, keep: float = 0.02, gamma: float = 64.0, alpha: float = 3.0,
                 beta: float = 1.0, pooling: str = "group", queries_per_step: int = 256, negatives: int = 1024,
                 seed: int = 0):
        if pooling not in POOLINGS:
            raise SparseKVError(f"pooling must be group or head, got {pooling!r}")
        if not 0 < keep < 1:
            raise SparseKVError(f"the kept share must be in (0, 1) (pruning rate {1 - keep:g}), got {keep}")
        self.data, self.patterns, self.keep = data, list(patterns), keep
        self.gamma, self.alpha, self.beta, self.pooling = gamma, alpha, beta, pooling
        self.queries_per_step, self.negatives, self.seed = queries_per_step, negatives, seed
        self._truth: dict[int, tuple] = {}  # held-out example index -> its exact top-k (fixed; computed once)

    def similarity(self, model: HashModel, ex: Example, hard: bool = False, margin: float = 0.0) -> torch.Tensor:
        """[L, Hsel, nq, nk]: the query codes' similarity to every key's, pooled. Soft codes (softsign) while
        training; `hard`: the ±1 codes the method stores (their inner product ranks as matching bits do), with
        `margin` the query's bits with |y| <= margin · rms(y) set to 0 (ternary queries: they count for no key, as
        in the method)."""
        L, Hq, nq, D = ex.q.shape
        Hkv = ex.k.shape[1]
        act = torch.sign if hard else (lambda x: softsign(x, self.gamma))
        hk = act(model(ex.k))  # [L, Hkv, nk, bits]
        yq = model(ex.q.reshape(L, Hkv, -1, D))  # the group's queries through their KV head's hash
        hq = act(yq)
        if hard and margin:
            hq = hq * query_care_reference(yq, margin)
        sim = torch.einsum("lhqb,lhkb->lhqk", hq, hk).view(L, Hkv, Hq // Hkv, nq, -1)
        return sim.sum(2) if self.pooling == "group" else sim.reshape(L, Hq, nq, -1)

    def truth(self, ex: Example):
        probs, vis = targets.attention_probs(ex.q, ex.k, ex.q_pos, self.patterns, self.pooling)
        k = targets.keep_count(vis.sum(-1)[0, 0], self.keep)
        idx, valid = targets.topk_sets(probs, vis, k)
        return idx, valid, vis, k

    def loss(self, model: HashModel, step: int) -> torch.Tensor:
        ex = self.data.sample(self.seed, step, self.queries_per_step)
        idx, valid, vis, _ = self.truth(ex)
        g = torch.Generator(ex.k.device).manual_seed(self.seed * 1_000_003 + step)  # the step's own draw: resumable
        per_query = rank_loss(self.similarity(model, ex), idx, valid, vis, self.alpha, self.beta, self.negatives, g)
        return per_query.mean(-1).sum()  # each head's mean; heads summed (their gradients stay their own)

    def heads_iou(self, model: HashModel, examples: Sequence[Example], margin: float = 0.0) -> torch.Tensor:
        """Mean IoU [L, Hsel] between each held-out query's top-k by hard codes (ternary queries with `margin`) and
        its exact top-k (same k)."""
        total, count = 0, 0
        with torch.no_grad():
            for n, ex in enumerate(examples):
                if n not in self._truth:
                    self._truth[n] = self.truth(ex)
                idx, valid, vis, k = self._truth[n]
                sim = self.similarity(model, ex, hard=True, margin=margin).double()  # integers (matching bits)
                nk = sim.shape[-1]
                order = torch.arange(nk, device=sim.device)
                sim = sim * nk + (order if CODE_TIES == "high" else nk - 1 - order)  # ties as the method breaks them
                got, _ = targets.topk_sets(sim, vis, k)
                total = total + targets.iou(targets.set_mask(got, valid, nk), targets.set_mask(idx, valid, nk)).sum(-1)
                count += ex.q.shape[2]
        return total / max(count, 1)


def train_hashes(acts: Activations, *, layers: Sequence[int] | None = None, nbits: int = 128, hidden: int = 128,
                 arch: str = "mlp", iters: int = 8192, keep: float = 0.02, gamma: float = 64.0, alpha: float = 3.0,
                 beta: float = 1.0, pooling: str = "group", queries_per_step: int = 64, negatives: int = 1024,
                 lr: float = 1e-3,
                 holdout: float = 0.1, heldout_queries: int = 256, eval_every: int = 0, patience: int = 2,
                 min_delta: float = 0.0, checkpoint_every: int = 512, linear: bool = False, seed: int = 0,
                 query_margin: float | None = None, device: str | torch.device = "cpu",
                 work: str | Path | None = None, resume: bool = False, progress: Any = None
                 ) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Fit the hashes of `layers` (default: all) to the dump; returns (tensors, config, report): tensors w1 [L, Hkv,
    D, hidden], b1 [L, Hkv, hidden], w2 [L, Hkv, hidden, nbits] (fp32) and layers [L] (the model layers they are for).
    `work`: the checkpoint folder (sparsekv.offline.stage.checkpoint_dir); `resume`: continue the run saved there.
    `query_margin`: after training, the held-out IoU of ternary queries at this margin (default: the method's,
    0.35) is measured beside that of binary ones, and the better margin goes into the config, which `spotlight`
    takes as its default (0 compares nothing: binary queries)."""
    options = dict(locals())
    del options["acts"]
    cfg, margin = check_options(**options)
    layers = fit_layers(layers, acts.num_layers)
    t0 = time.perf_counter()
    tick = Ticker(progress, len(layers), "load dump")
    data = DumpExamples(acts, layers, holdout=holdout, device=device, progress=tick.advance, min_keys=2)
    patterns = [acts.patterns()[i] for i in layers]
    obj = SpotlightObjective(data, patterns, keep=keep, gamma=gamma, alpha=alpha, beta=beta, pooling=pooling,
                             queries_per_step=queries_per_step, negatives=negatives, seed=seed)
    held = data.held_out(heldout_queries, seed)
    L, Hkv, D = len(layers), acts.kv_heads, acts.head_dim
    config = {"arch": "mlp", "hidden": hidden, "nbits": nbits, "pooling": pooling, "keep": keep,
              "pruning_rate": 1 - keep, "gamma": gamma, "alpha": alpha, "beta": beta,
              "queries_per_step": queries_per_step, "negatives": negatives or "all", "layers": list(layers),
              "input": "post-RoPE q/k",
              "code": "bit i = 1[MLP(x)_i > 0], 16 bits per int16 word (bit i of word i // 16 at position i % 16)",
              "train": {"iters": iters, "lr": lr, "min_lr": cfg.min_lr, "warmup": cfg.warmup,
                        "optimizer": cfg.optimizer, "betas": list(cfg.betas), "weight_decay": cfg.weight_decay,
                        "clip": cfg.clip, "seed": seed, "holdout": holdout, "eval_every": cfg.eval_every,
                        "patience": patience, "min_delta": min_delta,
                        "kept": "highest held-out iou" if cfg.best_by else "last"}}
    model = HashModel(L, Hkv, D, hidden, nbits, seed=seed).to(device)
    iou_before = obj.heads_iou(model, held)
    lsh = HashModel(L, Hkv, D, arch="linear", init_linear=_lsh_planes(layers, Hkv, D, nbits, seed)).to(device)
    iou_lsh = obj.heads_iou(lsh, held)
    report: dict[str, Any] = {"heldout": {"sequences": len(held), "queries": sum(e.q.shape[2] for e in held),
                                          "from_fit_sequences": not data.held_seqs}}
    run = train(model, lambda step: obj.loss(model, step), cfg, checkpoint_dir=work, resume=resume,
                identity={"stage": "train-hash", "config": config, "data": data_record(acts)},
                evaluate=lambda: {"iou": float(obj.heads_iou(model, held).mean())}, progress=progress,
                label="train-hash", show="iou")
    iou_after = obj.heads_iou(model, held)
    # ternary queries rank better when the hash's small outputs are its unreliable bits: measured, not assumed
    margins = {0.0: float(iou_after.mean())}
    if margin:
        margins[margin] = float(obj.heads_iou(model, held, margin).mean())
    config["query_margin"] = max(margins, key=lambda m: (margins[m], -m))
    report["query_margin"] = {"held_out_iou": {str(m): round(v, 4) for m, v in margins.items()},
                              "chosen": config["query_margin"]}
    report["train"] = run.report()
    ious = {"mlp_before": iou_before, "mlp_after": iou_after, "linear_before": iou_lsh}
    if linear:
        lin_cfg = TrainConfig(iters=iters, lr=lr, checkpoint_every=0, seed=seed)
        train(lsh, lambda step: obj.loss(lsh, step), lin_cfg, progress=progress, label="train-hash (linear)")
        ious["linear_after"] = obj.heads_iou(lsh, held)
    report["iou"] = {"mean": {k: round(float(v.mean()), 4) for k, v in ious.items()},
                     "per_layer": [{"layer": layer, **{k: round(float(v[i].mean()), 4) for k, v in ious.items()}}
                                   for i, layer in enumerate(layers)],
                     "per_head": {k: [[round(float(x), 4) for x in row] for row in v.tolist()]
                                  for k, v in ious.items()}}
    report["seconds"] = round(time.perf_counter() - t0, 2)
    report["device"] = device_label(device)
    tensors = {"w1": model.w1.detach().float().cpu().contiguous(), "b1": model.b1.detach().float().cpu().contiguous(),
               "w2": model.w2.detach().float().cpu().contiguous(), "layers": torch.tensor(list(layers))}
    return tensors, config, report


def check_options(**options: Any) -> tuple[TrainConfig, float]:
    """train_hashes' checks that need no dump (`train-hash` runs them before it reads one), one SparseKVError line
    naming the option; -> the training loop's config and the query margin to compare with binary queries."""
    from .methods.base import margin_option
    from .methods.spotlight import Spotlight

    o = with_defaults(train_hashes, options)
    margin = margin_option(Spotlight.default_query_margin if o["query_margin"] is None else o["query_margin"],
                           "--query-margin")
    for name, v in (("--bits", o["nbits"]), ("--hidden", o["hidden"])):
        if v < 16 or v % 16:
            raise SparseKVError(f"{name} must be a positive multiple of 16, got {v}")
    if o["arch"] != "mlp":
        raise SparseKVError("train-hash fits the MLP hash (arch mlp); the linear one is trained with --linear")
    for name, v in (("--gamma", o["gamma"]), ("--alpha", o["alpha"]), ("--beta", o["beta"])):
        if not math.isfinite(v) or v <= 0:
            raise SparseKVError(f"{name} must be a positive number, got {v}")
    if o["queries_per_step"] < 1 or o["heldout_queries"] < 1 or o["negatives"] < 0:
        raise SparseKVError("--queries-per-step and --heldout-queries must be >= 1, --negatives >= 0")
    if o["pooling"] not in POOLINGS:
        raise SparseKVError(f"--pooling must be group or head, got {o['pooling']!r}")
    if not 0 < o["keep"] < 1:
        raise SparseKVError(f"--pruning must be in (0, 1), got {1 - o['keep']:g}")
    check_holdout(o["holdout"], o["patience"])
    cfg = TrainConfig(iters=o["iters"], lr=o["lr"], checkpoint_every=o["checkpoint_every"], seed=o["seed"],
                      eval_every=o["eval_every"] or max(1, o["iters"] // 8), best_by="iou" if o["patience"] else "",
                      best_mode="max", patience=o["patience"], min_delta=o["min_delta"])
    cfg.check()
    return cfg, margin


def fit_hashes(acts: Activations, root: str | Path, *, resume: bool = False, version: str | None = None,
               progress: Any = None, **options: Any) -> tuple[Path, dict]:
    """train_hashes from dump to artifact (sparsekv.offline.stage.fit_and_save: checkpoints under `root`, `resume`,
    the artifact written and the checkpoints removed). Returns (path, report)."""
    def fit(acts, **kw):
        tensors, config, report = train_hashes(acts, **kw)
        return {"hash": tensors}, config, report

    return fit_and_save(acts, root, METHOD, "train-hash", fit, resume=resume, version=version, progress=progress,
                        **options)


def _lsh_planes(layers: Sequence[int], kv_heads: int, d: int, nbits: int, seed: int) -> torch.Tensor:
    """The `lsh` method's hyperplanes for these layers (angular LSH, Appendix A.5): [L, Hkv, D, nbits]."""
    from .methods.lsh import LSH

    lsh = LSH(nbits=nbits, seed=seed)
    return torch.stack([lsh.hyperplanes(i, kv_heads, d) for i in layers])

