"""Prototype, not adopted (results/eval-smollm2.md, session 16): adamas --distance ip with an exact re-rank.

Registers method "adamas_rr": ip scores pick `rerank` x k candidates, their exact q.k (the cached keys) keeps k.
Use: python results/scripts/eval_plan.py with this module imported first (it was run as
`import sys, runpy; sys.path.insert(0, "results/scripts"); import adamas_rerank_proto; runpy.run_path(...)`)."""
import torch
from sparsekv.methods.adamas import Adamas
from sparsekv.methods.base import register
from sparsekv.selection import Selection, topk


@register
class AdamasRR(Adamas):
    name = "adamas_rr"

    def __init__(self, *a, rerank: int = 4, **kw):
        self.name = "adamas"  # the artifact is adamas'
        super().__init__(*a, **kw)
        self.rerank = rerank

    def config(self):
        return {**super().config(), "rerank": self.rerank, "variant": "adamas_rr"}

    def select(self, state, q, q_pre_rope):
        split = self.split(state.length)
        if split.dense:
            return Selection(state.length, dense=True)
        lo, hi = split.sink, state.length - split.window
        n = hi - lo
        k = min(split.k, n)
        m = min(self.rerank * k, n)
        scores = self.ip_scores(state, q, lo, hi)  # [B, H, n]
        cand = topk(scores, m)  # [B, H, m] relative
        B, Hq, _, D = q.shape
        Hkv = state.keys.shape[1]
        H = scores.shape[1]
        keys = state.keys[:, :, lo:hi]
        if H == Hq:  # per query head: each head's candidates from its KV head
            kv = torch.arange(Hq, device=q.device) // (Hq // Hkv)
            kh = keys[:, kv]  # [B, Hq, n, D]
            ck = torch.gather(kh, 2, cand.unsqueeze(-1).expand(-1, -1, -1, D)).float()
            ex = torch.einsum("bhd,bhmd->bhm", q[:, :, 0].float(), ck)
        else:  # pooling group: the group's summed softmax over the candidates, as the oracle pools
            g = Hq // Hkv
            ck = torch.gather(keys, 2, cand.unsqueeze(-1).expand(-1, -1, -1, D)).float()
            qg = q[:, :, 0].float().view(B, Hkv, g, D)
            ex = torch.einsum("bhgd,bhmd->bhgm", qg, ck)
            ex = torch.softmax(ex * D**-0.5, -1).sum(2)
        top = torch.topk(ex, k, dim=-1).indices
        idx = torch.gather(cand, 2, top) + lo
        return Selection(state.length, split.sink, split.window, indices=idx, padded=False)
