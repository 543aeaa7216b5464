"""Selection quality on dumped activations: how much of each query's exact attention a method's choice keeps.

For every dumped query (position p in its sequence) and every layer, each method's state is grown over the keys
[0, p] of that sequence in position order, through `new_state` / `append` only, exactly as a decode would have
indexed them (post-RoPE keys and queries, plus pre-RoPE ones for methods with `needs_pre_rope`); then `select` is
called with the query, and its `Selection` is expanded to the keys it reads (sink + sparse part + window, the
kernels' own slots: `Selection.positions`). Against the exact attention of the query (softmax of q·k/sqrt(d) over
[0, p], per query head, each on its GQA group's KV head):

- attention_mass_recall: the softmax mass on the attended keys (mean over query heads). `score` is this, x100.
- topk_recall: the share of the exact top-k keys that are attended, k = keys attended by that selection row;
  the exact top-k is pooled as the method pools (pooling "group": top-k of the group's summed probabilities, the
  oracle's choice; "head": each query head's own). topk_recall_head: against each query head's own top-k.
- iou: |A ∩ O| / |A ∪ O| between the attended set A and the oracle's O at the same budget, sink, window and
  pooling (the reference's config is in `iou_reference`); oracle_mass_recall is O's attention mass (the bound).
  The reference takes the method's `sink` and `window` attributes: a method whose window is derived from the
  budget (StreamingLLM's "budget - sink") has window 0 there, so its oracle spends the rest on exact top-k.

On a prompt dump (`dump --task`, which records each prompt's evidence: the tokens that spell its answer), three
more measures say whether the selection reads what the answer is copied from:

- evidence_recall: of the exact attention the queries put on the evidence, the share on attended keys (sums over
  queries and query heads, then over layers: a layer counts by how much it attends to the evidence);
  oracle_evidence_recall: the same for the oracle's set.
- evidence_share: the evidence's share of the exact attention (mean over queries and query heads).

Text dumps have no evidence: these are None there.

Dense layers (`dense_layers`, eval's --dense-layers) are what a decode does with them: attended densely, the method
never selects there. Their selection would be exact by construction, so they are not scored (as the queries whose
whole context fits the budget are left out): their `per_layer` rows say "dense": true with no measures, the means
and the decode statistics are over the other layers, and the result lists them in `dense_layers`.

Why states are grown rather than built once and truncated (`state.length = p + 1`): methods with per-page or
per-segment summaries (Quest's min/max, RADAR's segment means) fold every appended key into the summary of its
page, so a state built over the whole sequence and cut back would leak later keys into the last partial page.
Appending in position order costs the same total work (each key is appended once per (sequence, layer)), holds
for every method that honours the append contract (chunks of any size, as prefill and decode append them), and
the shared K buffer is filled only up to the current length, zeros beyond, as in the runtime cache.
Dumps hold no values: methods get a zero value buffer (no registered method reads values to select).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


from ..activations import Activations, check_fingerprint
from ..cache import DecodeStats
from ..errors import SparseKVError
from ..jsonio import device_label
from ..patterns import FULL, AttentionPattern
from ..methods import CacheShape, Method, get_method
from ..models import LoadedModel
from ..selection import Selection
from .result import CellResult, decode_means
from .runner import RunSpec, check_specs

PROTOCOL = ("selection quality on dumped activations (offline, no model forward): for each dumped query at position "
            "p, the method's state is grown over keys [0, p] of its sequence in position order with new_state/append "
            "as a decode would index them (post-RoPE; pre-RoPE for methods that ask), then select(query); against "
            "exact softmax(q·k/sqrt(d)) over [0, p] per query head: attention mass on the attended keys "
            "(sink + window + selected), recall of the exact top-k (k = keys attended, pooled as the method pools; "
            "_head: per query head), IoU with the oracle's attended set at the same budget/sink/window/pooling; "
            "means over query heads, queries, then layers (dense layers: not scored); score = 100 x "
            "attention_mass_recall; prompt dumps: evidence_recall = attended share of the exact attention on the "
            "prompt tokens that spell the answer (sums over queries, query heads and layers)")

METRICS = ("attention_mass_recall", "topk_recall", "topk_recall_head", "iou", "oracle_mass_recall")
EVIDENCE = ("evidence_recall", "oracle_evidence_recall", "evidence_share")


@dataclass
class DumpModel:
    """Stands in for a LoadedModel in `Method.bind` when no model is loaded: the dump's recorded fingerprint."""

    name: str
    source: str
    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    recorded: dict = field(repr=False, default_factory=dict)

    def fingerprint(self) -> dict:
        return dict(self.recorded)

    @classmethod
    def from_dump(cls, acts: Activations) -> "DumpModel":
        fp = acts.manifest.get("model") or {}
        return cls(str(fp.get("name", "")), f"dump {acts.path}", acts.num_layers, acts.q_heads, acts.kv_heads,
                   acts.head_dim, fp)


@dataclass
class _Acc:
    """Running sums for one (spec, layer): metric sums over (query, query head), and the query count."""

    sums: dict = field(default_factory=lambda: {k: 0.0 for k in METRICS})
    n: int = 0  # (query, query head) pairs
    queries: int = 0
    dense: int = 0  # queries whose selection was the whole context
    stats: DecodeStats = field(default_factory=DecodeStats)
    # evidence: exact attention on it read by the selection, in all, read by the oracle; sum of its share; pairs
    ev: dict = field(default_factory=lambda: {"read": 0.0, "total": 0.0, "oracle": 0.0, "share": 0.0, "n": 0})

    def mean(self, key: str) -> float | None:
        return self.sums[key] / self.n if self.n else None

    def evidence(self) -> dict[str, float | None]:
        e = self.ev
        if not e["n"]:
            return dict.fromkeys(EVIDENCE)
        ratio = (lambda x: x / e["total"]) if e["total"] > 0 else (lambda x: None)
        return {"evidence_recall": ratio(e["read"]), "oracle_evidence_recall": ratio(e["oracle"]),
                "evidence_share": e["share"] / e["n"]}


def default_min_context(budgets: list[float]) -> int:
    """Queries whose whole context fits the budget are trivially exact: by default only those that see more keys
    than the largest token budget are evaluated (a fractional budget sets no floor)."""
    counts = [b for b in budgets if b >= 1]
    return int(max(counts)) + 1 if counts else 0


def query_rows(acts: Activations, max_queries: int | None = None, min_context: int = 0) -> torch.Tensor:
    """The dump's query rows to evaluate: those whose context (p + 1) is at least `min_context`, then at most
    `max_queries` of them, evenly spaced over the dump (every sequence and position range; no seed needed)."""
    pos = acts.positions()
    rows = torch.nonzero(pos["q_pos"] + 1 >= min_context).flatten()
    if max_queries is not None:
        if max_queries < 1:
            raise SparseKVError(f"max_queries must be positive, got {max_queries}")
        if len(rows) > max_queries:
            rows = rows[torch.linspace(0, len(rows) - 1, max_queries).round().long().unique()]
    if len(rows) == 0:
        raise SparseKVError(f"the dump at {acts.path} has no queries with a context of {min_context} or more tokens")
    return rows


def recall_grid(acts: Activations, specs: list[RunSpec], lm: LoadedModel | None = None,
                on_item: Callable[[], object] | None = None, max_queries: int | None = None,
                min_context: int = 0, dense_layers: tuple[int, ...] | list[int] = ()) -> list[dict]:
    """Selection quality of every spec on the dump's queries (module docstring). One result dict per spec.

    `lm`: the model the dump came from (checked by fingerprint); only needed by methods whose `bind` needs more
    than the dump's recorded fingerprint (artifacts are checked against it without a model). Work runs on lm's
    device when given (GPU kernels there), else on the CPU. `on_item()` is called once per (layer, query):
    `(num_layers - dense layers) * n` calls. `min_context`: skip queries that see fewer keys (e.g. the budget, to
    leave out queries whose selection is trivially the whole context; those count in `queries_dense` otherwise).
    `dense_layers`: layers the method does not select in, not scored (module docstring).
    """
    seq_len = max(acts.seq_lengths)
    check_specs(specs, seq_len)
    dense = frozenset(dense_layers)
    bad = sorted(i for i in dense if not 0 <= i < acts.num_layers)
    if bad:
        raise SparseKVError(f"dense layer(s) {bad} out of range: the dump has {acts.num_layers} layers "
                            f"(0..{acts.num_layers - 1})")
    if len(dense) >= acts.num_layers:
        raise SparseKVError("every layer of the dump is dense: recall has no layer left to score")
    acts.check_files()  # a corrupt layer stops here, before the work, not when it is reached
    if lm is not None:
        check_fingerprint(acts.path, acts.manifest.get("model") or {}, lm.fingerprint())
    target = lm if lm is not None else DumpModel.from_dump(acts)
    device = lm.device if lm is not None else torch.device("cpu")

    methods = [get_method(sp.method, budget=sp.budget or 1.0, **sp.method_options) for sp in specs]
    runners: list[Method] = list(methods)  # every method run, references included, each once
    ref_of: list[int | None] = []
    for sp, m in zip(specs, methods):
        if sp.budget is None:  # no budget (dense): no oracle at "the same budget"
            ref_of.append(None)
            continue
        ref = get_method("oracle", budget=sp.budget, sink=m.sink, window=m.window, pooling=m.pooling)
        same = [j for j, r in enumerate(runners) if r.config() == ref.config()]
        if not same:
            runners.append(ref)
        ref_of.append(same[0] if same else len(runners) - 1)
    for m in runners:
        _bind(m, target)

    rows = query_rows(acts, max_queries, min_context)
    L = acts.num_layers
    acc = [[_Acc() for _ in range(L)] for _ in specs]
    seconds = [0.0] * len(specs)
    pre_rope = any(m.needs_pre_rope for m in runners)
    pos = acts.positions()
    per_seq = [(s, rows[pos["q_seq"][rows] == s]) for s in range(len(acts.seq_lengths))]
    per_seq = [(s, r[pos["q_pos"][r].argsort()]) for s, r in per_seq if len(r)]
    evidence = acts.evidence()  # prompt dumps: the tokens each answer is copied from
    patterns = acts.patterns()
    t_start = time.perf_counter()
    for layer in range(L):
        if layer in dense:
            continue
        data = acts.layer(layer)
        for s, qrows in per_seq:
            off, n = acts.seq_offsets[s], acts.seq_lengths[s]
            keys = data["k_post"][:, off : off + n].to(device, torch.float32).unsqueeze(0)  # [1, Hkv, n, D]
            keys_pre = data["k_pre"][:, off : off + n].to(device, torch.float32).unsqueeze(0) if pre_rope else None
            qs = data["q_post"][:, qrows].to(device, torch.float32)  # [Hq, nq, D]
            qs_pre = data["q_pre"][:, qrows].to(device, torch.float32) if pre_rope else None
            _run_sequence(layer, runners, methods, ref_of, acc, seconds, keys, keys_pre, qs, qs_pre,
                          data["q_pos"][qrows].tolist(), on_item, patterns[layer],
                          None if evidence is None else evidence[s].to(device))
    total = time.perf_counter() - t_start
    other = max(total - sum(seconds), 0.0) / len(specs)  # exact attention, loading: split evenly
    return [_result(acts, lm, sp, m, None if r is None else runners[r], a, seq_len, len(rows), sec + other, dense)
            for sp, m, r, a, sec in zip(specs, methods, ref_of, acc, seconds)]


def _bind(method: Method, target: Any) -> None:
    try:
        method.bind(target)
    except SparseKVError:
        raise
    except (AttributeError, TypeError) as e:
        raise SparseKVError(f"method {method.name!r} needs the loaded model to bind ({e}): pass the model the dump "
                            f"came from") from None


def _run_sequence(layer, runners, methods, ref_of, acc, seconds, keys, keys_pre, qs, qs_pre, qpos, on_item,
                  pattern: AttentionPattern = FULL, evidence: torch.Tensor | None = None) -> None:
    """Grow every runner's state over one sequence, query by query, and score each spec's selections. `pattern`:
    what the layer attends (a query sees only its sliding window, with the layer's scale and softcapping).
    `evidence`: positions in this sequence the answer is copied from (prompt dumps), scored as well."""
    _, Hkv, n, D = keys.shape
    Hq = qs.shape[0]
    G = Hq // Hkv
    device = keys.device
    shape = CacheShape(1, Hkv, Hq, D, n, torch.float32, device)
    kbuf = torch.zeros_like(keys)  # filled up to the current length only, as the runtime's cache
    vbuf = torch.zeros_like(keys)
    states = []
    for m in runners:
        st = m.new_state(layer, shape)
        st.keys, st.values, st.length, st.pattern = kbuf, vbuf, 0, pattern
        states.append(st)
    cur = 0
    scale = pattern.scaling if pattern.scaling is not None else D**-0.5
    for j, p in enumerate(qpos):
        end = p + 1
        times = [0.0] * len(runners)
        if end > cur:
            kbuf[:, :, cur:end] = keys[:, :, cur:end]
            for i, (m, st) in enumerate(zip(runners, states)):
                t0 = time.perf_counter()
                st.length = end
                m.append(st, kbuf[:, :, cur:end], vbuf[:, :, cur:end],
                         keys_pre[:, :, cur:end] if m.needs_pre_rope else None, cur)
                times[i] += time.perf_counter() - t0
            cur = end
        q = qs[:, j].view(1, Hq, 1, D)
        q_pre = qs_pre[:, j].view(1, Hq, 1, D) if qs_pre is not None else None
        sels: list[Selection] = []
        for i, (m, st) in enumerate(zip(runners, states)):
            t0 = time.perf_counter()
            sels.append(m.select(st, q, q_pre if m.needs_pre_rope else None))
            times[i] += time.perf_counter() - t0
        # exact attention of this query over the keys it sees ([0, p], or its window), per query head on its KV head
        logits = torch.einsum("hgd,hnd->hgn", q.view(Hkv, G, D), keys[0, :, :end]).reshape(Hq, end).double() * scale
        if pattern.softcap:
            logits = pattern.softcap * torch.tanh(logits / pattern.softcap)
        logits[:, : pattern.start(end)] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        masks = {}
        for i, sel in enumerate(sels):
            if i < len(methods) or i in ref_of:
                masks[i] = _attended(sel, Hkv, Hq, end, device)
        for i, m in enumerate(methods):
            seconds[i] += times[i]
            a = acc[i][layer]
            mask = masks[i]  # [Hs, end]
            ref = masks[ref_of[i]] if ref_of[i] is not None else None
            _score(a, probs, mask, ref, Hkv, G, None if evidence is None else evidence[evidence < end])
            sel = sels[i]
            a.queries += 1
            a.dense += int(bool(mask[:, pattern.start(end) :].all()))
            a.stats.add_selection(sel)
        if on_item:
            on_item()


def _attended(sel: Selection, kv_heads: int, q_heads: int, length: int, device) -> torch.Tensor:
    """Bool [Hs, length]: the keys the selection reads, per selection head (KV heads or query heads)."""
    hs = sel.heads(kv_heads)
    if sel.length != length:
        raise SparseKVError(f"a selection for {sel.length} keys came back at length {length}")
    if hs != kv_heads and hs != q_heads:
        raise SparseKVError(f"a selection has {hs} heads; expected {kv_heads} (KV heads) or {q_heads} (query heads)")
    pos = sel.positions(1, hs, device=device)[0]  # [Hs, slots], -1 = nothing
    mask = torch.zeros(hs, length + 1, dtype=torch.bool, device=device)
    mask.scatter_(1, torch.where(pos >= 0, pos, length), True)  # padding goes to the spare column
    return mask[:, :length]


def _to_heads(x: torch.Tensor, Hq: int, G: int) -> torch.Tensor:
    """[Hs, ...] per selection head -> [Hq, ...] per query head (a group row serves its G query heads)."""
    return x if x.shape[0] == Hq else x.repeat_interleave(G, dim=0)


def _topk_recall(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row: share of the row's exact top-k (k = keys the row attends) that it attends."""
    k = mask.sum(-1)  # [R]
    kmax = int(k.max())
    if kmax == 0:
        return torch.ones(mask.shape[0], dtype=torch.float64, device=mask.device)
    top = torch.topk(scores, kmax, dim=-1, sorted=True).indices  # [R, kmax]
    keep = torch.arange(kmax, device=mask.device) < k.unsqueeze(1)  # row r keeps its first k_r
    hits = (mask.gather(1, top) & keep).sum(-1)
    return hits.double() / k.clamp(min=1).double()


def _score(a: _Acc, probs: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor | None, Hkv: int, G: int,
           evidence: torch.Tensor | None = None) -> None:
    """One query's measures into `a`; `evidence`: the positions it sees that spell the answer (prompt dumps)."""
    Hq = probs.shape[0]
    m = _to_heads(mask, Hq, G)  # [Hq, L]
    mass = (probs * m).sum(-1)
    if mask.shape[0] == Hq:  # pooling per query head: the head's own top-k
        pooled = _topk_recall(probs, mask)
    else:  # one choice per group: the group's top-k of summed probabilities
        pooled = _topk_recall(probs.view(Hkv, G, -1).sum(1), mask).repeat_interleave(G)
    head = _topk_recall(probs, m)
    if ref is not None:
        r = _to_heads(ref, Hq, G)
        iou = (m & r).sum(-1).double() / (m | r).sum(-1).clamp(min=1).double()
        ref_mass = (probs * r).sum(-1)
    else:
        r = None
        iou = ref_mass = torch.full((Hq,), float("nan"), dtype=torch.float64)
    if evidence is not None:
        _score_evidence(a, probs, m, r, evidence)
    for key, v in (("attention_mass_recall", mass), ("topk_recall", pooled), ("topk_recall_head", head),
                   ("iou", iou), ("oracle_mass_recall", ref_mass)):
        a.sums[key] += float(v.sum())
    a.n += Hq


def _score_evidence(a: _Acc, probs: torch.Tensor, m: torch.Tensor, r: torch.Tensor | None,
                    evidence: torch.Tensor) -> None:
    """Evidence measures of one query (module docstring): `m`, `r` the method's and the oracle's attended keys per
    query head ([Hq, L]); `evidence`: positions the query can see."""
    on = probs[:, evidence]  # [Hq, E]: exact attention on the evidence
    a.ev["total"] += float(on.sum())
    a.ev["read"] += float((on * m[:, evidence]).sum())
    if r is not None:
        a.ev["oracle"] += float((on * r[:, evidence]).sum())
    a.ev["share"] += float(on.sum())
    a.ev["n"] += probs.shape[0]


def _result(acts: Activations, lm, spec: RunSpec, method: Method, ref: Method | None, acc: list[_Acc],
            seq_len: int, n_queries: int, seconds: float, dense: frozenset = frozenset()) -> dict:
    def mean(key: str) -> float | None:
        vals = [a.mean(key) for a in acc if a.n]
        vals = [v for v in vals if v == v]  # NaN: no reference
        return sum(vals) / len(vals) if vals else None

    def r4(v):
        return None if v is None or v != v else round(v, 6)

    def evidence(a: _Acc) -> dict[str, float | None]:
        out = a.evidence()
        return {**out, "oracle_evidence_recall": None} if ref is None else out

    total = _Acc()  # evidence sums over the layers (dense ones hold none: they are not scored)
    for a in acc:
        for k in total.ev:
            total.ev[k] += a.ev[k]

    per_layer = [{"layer": i, **{k: r4(a.mean(k)) for k in METRICS}, **{k: r4(v) for k, v in evidence(a).items()},
                  "selectivity": r4(a.stats.summary()["selectivity"]),
                  "queries_dense": r4(a.dense / a.queries if a.queries else None), "dense": i in dense}
                 for i, a in enumerate(acc)]
    mass = mean("attention_mass_recall")
    return CellResult(
        task="recall", metric="attention_mass_recall", score=None if mass is None else 100.0 * mass,
        method=spec.method, method_config=method.config(), budget=spec.budget, seq_len=seq_len, n=n_queries,
        decode=decode_means([a.stats.summary() for i, a in enumerate(acc) if i not in dense]),
        model=(acts.manifest.get("model") or {}).get("name", ""),
        model_source=lm.source if lm is not None else f"dump {acts.path}", artifact=spec.method_options.get("artifact"),
        seed=acts.data.get("seed"),  # the dump's seed: its query sampling, or its prompts' for a prompt dump
        protocol=PROTOCOL, device=device_label(lm.device) if lm is not None else "cpu", seconds=seconds,
        dense_layers=sorted(dense),
        measures={**{k: mean(k) for k in METRICS}, **evidence(total),
                  "iou_reference": None if ref is None else ref.config()},
        task_fields={
            # share of (layer, query) selections that read the whole context
            "queries_dense": sum(a.dense for a in acc) / max(sum(a.queries for a in acc), 1),
            "dump": str(acts.path), "text_source": acts.data.get("source", ""), "per_layer": per_layer,
        }).to_json()
