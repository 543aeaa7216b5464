"""Plain-torch references of the kernels: the spec each Triton kernel must match (same signatures, fp32 maths).

Clarity over speed: these are what the tests compare the kernels against, and the CPU fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def window_start(lengths: torch.Tensor, span: int) -> torch.Tensor:
    """First key the newest of `lengths` keys may see under a sliding window of `span` keys (0: every key): the
    references' copy of kernels/region.py::window_first."""
    return (lengths - span).clamp(min=0) if span else torch.zeros_like(lengths)


def decode_positions(batch: int, heads: int, lengths: int | torch.Tensor, indices: torch.Tensor | None = None,
                     sink: int = 0, window: int = 0, span: int = 0, dense: bool = False,
                     device=None) -> torch.Tensor:
    """Every position one decode step reads, [B, H, n] int64, -1 where a slot reads nothing.

    The step's keys as the kernels take them: each row's valid `lengths` (int, or [B]), and either every key the
    layer may see (`dense`) or the dense part (the first `sink` and last `window` keys it may see) plus the sparse
    `indices` [B or 1, H, k] (-1 pads). Slot order is the kernels' too: sink, then the sparse part, then the window;
    slots at or past a row's length read nothing, and so do sparse positions outside the row's sparse region (a row
    shorter than the region a graph-replayed step selects over may be handed some: they never count twice). A layer with a sliding window (`span`) sees only
    [length - span, length): the dense slots start there, and nothing before it is read.
    """
    L = torch.as_tensor(lengths, device=device).long().reshape(-1, 1, 1).expand(batch, 1, 1)
    start = window_start(L, span)
    if dense:
        pos = torch.arange(int(L.max()), device=device).view(1, 1, -1).expand(batch, heads, -1)
        return torch.where((pos < L) & (pos >= start), pos, -1)
    sink_pos = (start + torch.arange(sink, device=device).view(1, 1, -1)).expand(batch, heads, -1)
    win = L - window + torch.arange(window, device=device).view(1, 1, -1)
    win = torch.where(win >= start + sink, win, -1).expand(batch, heads, -1)  # a short row: no sink re-read
    parts = [sink_pos]
    if indices is not None:  # outside the row's sparse region [start + sink, length - window): nothing
        sp = indices.to(device).long().expand(batch, heads, -1)
        parts.append(torch.where((sp >= start + sink) & (sp < L - window), sp, -1))
    parts.append(win)
    pos = torch.cat(parts, dim=-1)
    return torch.where((pos >= start) & (pos < L), pos, -1)


@dataclass(frozen=True)
class RowBounds:
    """The region a graph-replayed step chooses from, per batch row, as kernels take it: key i of a row sliced at
    `lo` (position lo + i) may be chosen iff start + sink <= lo + i < length - window, with the row's device length
    `lengths[b]` and start its sliding window's first key (0 when span is 0). Kernels read the length on the device
    (no mask tensor is built); `mask` is the same region as a bool tensor (the references)."""

    lengths: torch.Tensor  # [B] integer, on the device of the data
    span: int = 0
    sink: int = 0
    window: int = 0
    lo: int = 0

    def mask(self, n: int) -> torch.Tensor:
        """bool [B, 1, n]: which of the n keys from lo each row may choose (few launches: a graph step replays
        them every layer)."""
        L = self.lengths.view(-1, 1, 1)
        first = window_start(L, self.span) + self.sink
        pos = torch.arange(self.lo, self.lo + n, device=L.device).view(1, 1, -1)
        return (pos >= first) & (pos < (L - self.window if self.window else L))

    def check(self, batch: int, device: torch.device) -> None:
        if (self.lengths.shape != (batch,) or self.lengths.device != device or self.lengths.is_floating_point()
                or self.lengths.is_complex()):
            raise ValueError(f"bounds.lengths must be an integer tensor [{batch}] on {device}, got "
                             f"{self.lengths.dtype} {tuple(self.lengths.shape)} on {self.lengths.device}")


def block_positions_reference(blocks: torch.Tensor, block_size: int, lengths: int | torch.Tensor, span: int = 0,
                              sink: int = 0, window: int = 0, count: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [B, H, nb] (block b covers positions [b·block_size, (b+1)·block_size), -1 = none) as padded token
    positions [B, H, nb·block_size], -1 outside each row's sparse region [start + sink, length - window) (`lengths`
    an int or per row [B]; start the sliding window's first key, 0 when span is 0): what the step reads of them;
    and how many that is per (row, head) on average, fp32 0-dim (the step's statistics), or with `count` (0-dim)
    that mean added into it, which is returned (a running sum over steps)."""
    offs = torch.arange(block_size, device=blocks.device)
    pos = blocks.long().unsqueeze(-1) * block_size + offs
    L = torch.as_tensor(lengths, device=blocks.device).long().reshape(-1, 1, 1, 1)
    lo = window_start(L, span) + sink
    pos = torch.where((blocks.unsqueeze(-1) >= 0) & (pos >= lo) & (pos < L - window), pos, -1).flatten(-2)
    mean = pos.ge(0).sum(-1).float().mean()
    return pos, mean if count is None else count.add_(mean)


def check_positions(pos: torch.Tensor) -> None:
    """Reject what the kernels assume away: duplicate positions in a row of `decode_positions` (a key would count
    twice in the softmax). Costs a sort and a host sync: for tests and debugging."""
    srt = pos.sort(-1).values
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    if bool(dup.any()):
        raise ValueError("selection has duplicate positions (a key would be attended twice)")


def selection_heads(q: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor | None, dense: bool) -> int:
    """Selection heads of a step: the sparse part's head count, else one per KV head; KV or query heads only."""
    Hq, Hkv = q.shape[1], keys.shape[1]
    Hs = indices.shape[1] if indices is not None and not dense else Hkv
    if Hs not in (Hkv, Hq):
        raise ValueError(f"selection has {Hs} heads; expected {Hkv} (KV heads) or {Hq} (query heads)")
    return Hs


def sparse_decode_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                            lengths: int | torch.Tensor, indices: torch.Tensor | None = None, *, sink: int = 0,
                            window: int = 0, span: int = 0, dense: bool = False, extent: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """One decode step of attention over the keys `decode_positions` names.

    q: [B, Hq, 1, D]; keys/values: [B, Hkv, >= length, D]; returns [B, Hq, 1, D] in q's dtype.
    `indices` has one row per KV head (a GQA group shares it) or one per query head. `extent` (the slots a kernel's
    grid covers) changes nothing here. `softcap`: logits s = q·k x scale become softcap * tanh(s / softcap).
    """
    B, Hq, _, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    Hs = selection_heads(q, keys, indices, dense)
    pos = decode_positions(B, Hs, lengths, indices, sink, window, span, dense, device=q.device)
    if Hs == Hkv:  # one key set per group: q rows of a group share it
        qs = q.float().view(B, Hkv, G, D)
        kv_head = torch.arange(Hkv, device=q.device)
    else:  # one key set per query head
        qs = q.float().view(B, Hq, 1, D)
        kv_head = torch.arange(Hq, device=q.device) // G
    valid = pos >= 0
    idx = pos.clamp(min=0)
    b_idx = torch.arange(B, device=q.device).view(B, 1, 1)
    k_sel = keys[b_idx, kv_head.view(1, -1, 1), idx].float()  # [B, Hs, n, D]
    v_sel = values[b_idx, kv_head.view(1, -1, 1), idx].float()
    logits = torch.einsum("bhgd,bhnd->bhgn", qs, k_sel) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row that reads no key comes out as zeros
    out = torch.einsum("bhgn,bhnd->bhgd", probs, v_sel)
    return out.reshape(B, Hq, 1, D).to(q.dtype)


def qk_logits_reference(q: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
    """The exact q·k (unscaled, fp32) [B, Hq, m] of the keys [B, Hkv, L, D] at indices [B, H, m] (H = Hkv or Hq;
    -1 gives -inf), or of every key when indices is None. Contract of `sparse_decode.qk_logits`."""
    B, Hq, _, D = q.shape
    Hkv = keys.shape[1]
    if indices is None:  # every key: no gather
        return torch.einsum("bhgd,bhmd->bhgm", q.float().view(B, Hkv, Hq // Hkv, D), keys.float()).reshape(B, Hq, -1)
    H, m = indices.shape[1], indices.shape[2]
    if H not in (Hkv, Hq):
        raise ValueError(f"indices: selection has {H} heads; expected {Hkv} (KV heads) or {Hq} (query heads)")
    b = torch.arange(B, device=keys.device).view(B, 1, 1)
    kv = (torch.arange(H, device=keys.device) // (H // Hkv)).view(1, H, 1)
    k_sel = keys[b, kv, indices.clamp(min=0)].float()  # [B, H, m, D]
    logits = torch.einsum("bhgd,bhmd->bhgm", q.float().view(B, H, Hq // H, D), k_sel)
    return logits.masked_fill((indices < 0).unsqueeze(2), float("-inf")).reshape(B, Hq, m)


def check_ties(ties: str) -> str:
    """`ties` of the selects: "low" (to the lower index) or "high" (to the higher); ValueError otherwise."""
    if ties not in ("low", "high"):
        raise ValueError(f"ties must be 'low' or 'high', got {ties!r}")
    return ties


def reversed_select(select, scores: torch.Tensor, k: int) -> torch.Tensor:
    """`select` (ties to the lower index, each row ascending) run on the reversed rows, mapped back: the same k
    with ties to the higher index, each row ascending."""
    n = scores.shape[-1]
    return (n - 1 - select(scores.flip(-1).contiguous(), k)).flip(-1)


def topk_reference(scores: torch.Tensor, k: int, out: torch.Tensor | None = None, config=None,
                   ties: str = "low") -> torch.Tensor:
    """Indices [..., k] int64 of the k largest scores per row, ties to the lower index (`ties="high"`: to the
    higher), each row ascending.

    A stable descending sort (NaN first, -0.0 tied with +0.0, as torch.sort orders them), its first k, sorted.
    `kernels.topk.topk`'s signature: `out` is filled and returned when given; `config` (its tuning knobs) is ignored.
    """
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} must be between 0 and the row length {n}")
    if check_ties(ties) == "high":
        idx = reversed_select(topk_reference, scores, k)
        return idx if out is None else out.copy_(idx)
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[..., :k]
    idx = order.sort(dim=-1).values
    return idx if out is None else out.copy_(idx)


# ---------------------------------------------------------------------------------------------------------------
# Packed codes, shared by Adamas (bucket codes of Hadamard(x)) and LSH (sign bits): Hadamard transform, bucketize,
# pack, code distances.

SUPPORTED_HADAMARD = "2^n (n>=0: 1, 2, 4, ..., 64, 128, 256), 12·2^n (12, 24, 48, 96, 192), 20·2^n (20, 40, 80, 160)"
_HADAMARD_CACHE: dict = {}


def _paley_hadamard(q: int) -> torch.Tensor:
    """Unnormalised ±1 Hadamard matrix of order q + 1 (Paley construction I, q prime, q ≡ 3 mod 4).

    H = I + S with S = [[0, 1ᵀ], [-1, Q]] and Q the Jacobsthal matrix Q_ij = χ(j - i) (χ: quadratic character
    mod q). Q is skew for q ≡ 3 mod 4, so S is skew and H Hᵀ = I + S Sᵀ = (q + 1) I.
    """
    squares = {(i * i) % q for i in range(1, q)}
    chi = [0] + [1 if a in squares else -1 for a in range(1, q)]
    Q = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float64)
    S = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    S[0, 1:] = 1.0
    S[1:, 0] = -1.0
    S[1:, 1:] = Q
    return torch.eye(q + 1, dtype=torch.float64) + S


def _hadamard_factor(d: int) -> tuple[int, int] | None:
    """(2^n, m) with d = 2^n · m and m in {1, 12, 20}, or None."""
    for m in (1, 12, 20):
        if d % m == 0:
            p = d // m
            if p >= 1 and p & (p - 1) == 0:
                return p, m
    return None


def hadamard_matrix(d: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Orthonormal Hadamard matrix H_d (H @ H.T = I), cached per (d, dtype, device). Do not modify it in place.

    Sylvester's H_{2^n} for powers of two (symmetric); otherwise H_{2^n} ⊗ H_m with H_12 and H_20 from Paley's
    construction I (q = 11, 19), which is *not* symmetric: its inverse is H.T. Supported d: SUPPORTED_HADAMARD.
    """
    d = int(d)
    fac = _hadamard_factor(d) if d >= 1 else None
    if fac is None:
        raise ValueError(f"no Hadamard matrix for head dim {d}; supported: {SUPPORTED_HADAMARD}")
    key = (d, dtype, str(torch.device(device) if device is not None else torch.device("cpu")))
    H = _HADAMARD_CACHE.get(key)
    if H is None:
        p, m = fac
        Hp = torch.ones(1, 1, dtype=torch.float64)
        h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        while Hp.shape[0] < p:
            Hp = torch.kron(h2, Hp)  # Sylvester: H_{2^n} = H_2 ⊗ H_{2^{n-1}}
        Hm = _paley_hadamard(m - 1) if m > 1 else torch.ones(1, 1, dtype=torch.float64)
        H = (torch.kron(Hp, Hm) / d ** 0.5).to(dtype=dtype, device=device)
        _HADAMARD_CACHE[key] = H
    return H


def hadamard_reference(x: torch.Tensor) -> torch.Tensor:
    """x @ H_d over the last dim (fp32 maths), in x's dtype. The paper's H_Q = Q H, H_K = K H (eq. 4)."""
    H = hadamard_matrix(x.shape[-1], torch.float32, x.device)
    return (x.float() @ H).to(x.dtype)


def _thresholds_for(x: torch.Tensor, thresholds: torch.Tensor, bits: int) -> torch.Tensor:
    """Thresholds broadcast against x [..., H, n, D]: [T] shared, or [Ht, T] with H % Ht == 0 (head h uses row
    h // (H // Ht): per-KV-head thresholds serve a GQA group of query heads)."""
    T = (1 << bits) - 1
    if thresholds.shape[-1] != T:
        raise ValueError(f"bits={bits} needs {T} thresholds per row, got shape {tuple(thresholds.shape)}")
    th = thresholds.to(device=x.device, dtype=torch.float32)
    if th.dim() == 1:
        return th
    if th.dim() != 2 or x.dim() < 3 or x.shape[-3] % th.shape[0] != 0:
        raise ValueError(f"thresholds {tuple(thresholds.shape)} do not fit x {tuple(x.shape)} "
                         "(expected [T] or [Ht, T] with x [..., H, n, D], H a multiple of Ht)")
    th = th.repeat_interleave(x.shape[-3] // th.shape[0], dim=0)  # [H, T]
    return th[:, None, None, :]  # against x[..., H, n, D, None]


def code_bucketize_reference(x: torch.Tensor, thresholds: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """Codes uint8 with x's shape: the number of thresholds strictly below x (paper eq. 5, B(x) = Σ 1[x > B_i]).

    x [..., H, n, D] with thresholds [H, 2^bits - 1] (or [Ht, ...], H % Ht == 0), or x [..., D] with shared
    thresholds [2^bits - 1]. Thresholds at -inf always count, at +inf never; NaN x gets 0.
    """
    th = _thresholds_for(x, thresholds, bits)
    return (x.float().unsqueeze(-1) > th).sum(-1).to(torch.uint8)


def _per_word(bits: int) -> int:
    if bits not in (1, 2, 3):
        raise ValueError(f"bits must be 1, 2 or 3, got {bits}")
    return {1: 16, 2: 8, 3: 5}[bits]


def code_pack_reference(codes: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """codes [..., D] (0 .. 2^bits - 1) -> int16 words [..., ceil(D / per_word)].

    Code i of a word's group sits at bits [bits·i, bits·(i+1)): 16 codes per word for bits=1, 8 for bits=2 (as the
    paper: eight 2-bit codes per 16-bit value), 5 for bits=3 (15 bits used, the top bit 0). Padding codes are 0.
    """
    pw = _per_word(bits)
    D = codes.shape[-1]
    W = -(-D // pw)
    c = torch.zeros(*codes.shape[:-1], W * pw, dtype=torch.int32, device=codes.device)
    c[..., :D] = codes.to(torch.int32)
    c = c.view(*codes.shape[:-1], W, pw)
    shifts = torch.arange(pw, device=codes.device, dtype=torch.int32) * bits
    word = (c << shifts).sum(-1)  # 0 .. 65535
    return torch.where(word >= 32768, word - 65536, word).to(torch.int16)


def code_unpack_reference(words: torch.Tensor, d: int, bits: int = 2) -> torch.Tensor:
    """Inverse of code_pack_reference: int16 words [..., W] -> uint8 codes [..., d]."""
    pw = _per_word(bits)
    w = words.to(torch.int32) & 0xFFFF
    shifts = torch.arange(pw, device=words.device, dtype=torch.int32) * bits
    c = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*words.shape[:-1], -1)[..., :d].to(torch.uint8)


def code_distance_reference(q_words: torch.Tensor, k_words: torch.Tensor, d: int, bits: int = 2,
                              metric: str = "l1", pool: str | None = None) -> torch.Tensor:
    """Code distances int32 [B, Hq, L]: Σ_dims |qc - kc| (l1, paper eq. 6) or Σ (qc - kc)² (l2); smaller = closer.

    q_words [B, Hq, W]; k_words [B, Hkv, L, W]; query head h reads KV head h // (Hq // Hkv).
    pool "sum" / "min" reduces over each KV head's query group -> [B, Hkv, L].
    1-bit codes also take ternary queries, q_words [B, Hq, 2W]: the sign words, then the care words
    (query_care_reference); a bit whose care bit is 0 counts for no key.
    """
    if metric not in ("l1", "l2"):
        raise ValueError(f"metric must be 'l1' or 'l2', got {metric!r}")
    B, Hq, Wq = q_words.shape
    Hkv, W = k_words.shape[1], k_words.shape[-1]
    care = None
    if bits == 1 and Wq == 2 * W:
        q_words, care = q_words[..., :W], code_unpack_reference(q_words[..., W:], d, 1).bool()
    qc = code_unpack_reference(q_words, d, bits).int()  # [B, Hq, d]
    kc = code_unpack_reference(k_words, d, bits).int()  # [B, Hkv, L, d]
    kc = kc.repeat_interleave(Hq // Hkv, dim=1)  # clarity over speed
    diff = qc.unsqueeze(2) - kc
    diff = diff.abs() if metric == "l1" else diff * diff
    if care is not None:
        diff = diff * care.unsqueeze(2)
    dist = diff.sum(-1)
    if pool is not None:
        if pool not in ("sum", "min"):
            raise ValueError(f"pool must be None, 'sum' or 'min', got {pool!r}")
        grouped = dist.view(B, Hkv, Hq // Hkv, -1)
        dist = grouped.sum(2) if pool == "sum" else grouped.amin(2)
    return dist.to(torch.int32)


def adamas_bucket_centers(thresholds: torch.Tensor) -> torch.Tensor:
    """A value for each bucket the thresholds [..., T] define: [..., T + 1] fp32, for the asymmetric score.

    Bucket b holds the values in (B_b, B_{b+1}] (B_0 = -inf, B_{T+1} = +inf). Between two finite thresholds its
    center is their midpoint; an outer bucket extends past its one finite threshold by half the nearest finite
    bucket's width (a width of 1 when the thresholds leave no finite bucket: one threshold t gives t ± 0.5); a
    bucket with no finite edge (every threshold infinite) gets 0. Buckets that ±inf thresholds leave empty get a
    finite value no key uses.
    On SmolLM2 these midpoints rank keys about as well as the buckets' conditional means, and much better than the
    L1 code distance (recall of the exact top-k on a jargon dump); accuracy: BENCHMARKS.md, "RULER NIAH on the
    default model, by budget".
    """
    t = thresholds.float()
    T = t.shape[-1]
    inf = torch.full_like(t[..., :1], float("inf"))
    lo, hi = torch.cat([-inf, t], -1), torch.cat([t, inf], -1)  # bucket edges [..., T + 1]
    fin_lo, fin_hi = torch.isfinite(lo), torch.isfinite(hi)
    finite = fin_lo & fin_hi  # buckets with two finite edges
    finite_w = torch.where(finite, hi - lo, torch.zeros_like(lo))
    # the outer buckets' nearest finite buckets are the first / last finite ones; with none, width 1
    idx = torch.arange(T + 1, device=t.device).expand_as(lo)
    first = torch.where(finite, idx, torch.full_like(idx, T + 1)).amin(-1, keepdim=True)
    last = torch.where(finite, idx, torch.full_like(idx, -1)).amax(-1, keepdim=True)
    has = last >= 0
    w_first = torch.where(has, finite_w.gather(-1, first.clamp(max=T)), torch.ones_like(first, dtype=t.dtype))
    w_last = torch.where(has, finite_w.gather(-1, last.clamp(min=0)), torch.ones_like(last, dtype=t.dtype))
    center = torch.zeros_like(lo)
    center = torch.where(finite, (lo + hi) / 2, center)
    center = torch.where(~fin_lo & fin_hi, hi - w_first / 2, center)
    center = torch.where(fin_lo & ~fin_hi, lo + w_last / 2, center)
    return center


def adamas_ip_scores_reference(q: torch.Tensor, k_words: torch.Tensor, centers: torch.Tensor, d: int,
                               bits: int = 2, pool: str | None = None) -> torch.Tensor:
    """Asymmetric scores fp32 [B, Hq, L] (higher = closer): the full-precision query q [B, Hq, d] (already in the
    codes' space, i.e. Hadamard-transformed when the codes are) against each key's codes read as their buckets'
    centers [Hkv, 2^bits] (adamas_bucket_centers): q · c[code(k)], an estimate of q · k. k_words [B, Hkv, L, W];
    query head h reads KV head h // (Hq // Hkv). pool "sum" adds each KV head's query group -> [B, Hkv, L]."""
    B, Hq, _ = q.shape
    Hkv = k_words.shape[1]
    kc = code_unpack_reference(k_words, d, bits).long()  # [B, Hkv, L, d]
    c = centers.float().to(q.device)
    levels = torch.stack([c[h][kc[:, h]] for h in range(Hkv)], 1)  # [B, Hkv, L, d]
    qg = q.float().view(B, Hkv, Hq // Hkv, d)
    if pool is not None:
        if pool != "sum":
            raise ValueError(f"pool must be None or 'sum', got {pool!r}")
        return torch.einsum("bhld,bhd->bhl", levels, qg.sum(2))
    return torch.einsum("bhld,bhgd->bhgl", levels, qg).reshape(B, Hq, -1)


def check_pending(codes: torch.Tensor, slots: torch.Tensor, B: int, Hkv: int, W: int, device: torch.device) -> None:
    """A pending decode-step append's code buffer, int16 [B, Hkv, Lmax, W] with contiguous words, and its device
    slots, integers [B]: what the launch that carries it out writes through (codes.quantize_pack, hash_mlp)."""
    if (codes.dtype != torch.int16 or codes.dim() != 4 or tuple(codes.shape[:2]) != (B, Hkv) or codes.shape[3] != W
            or codes.stride(-1) != 1 or codes.device != device):
        raise ValueError(f"append.codes must be int16 [{B}, {Hkv}, Lmax, {W}] on {device} with contiguous words, "
                         f"got {codes.dtype} {tuple(codes.shape)} on {codes.device}")
    if slots.shape != (B,) or slots.device != device or slots.is_floating_point() or slots.is_complex():
        raise ValueError(f"append.slots must be an integer tensor [{B}] on {device}, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {slots.device}")


@dataclass(frozen=True)
class PendingCodes:
    """A decode step's key codes (quantize_pack_into of k [B, Hkv, 1, D] with its thresholds into `codes` at device
    slots [B]) handed to the step's query coding, which carries it out first (the kernel: in the same launch)."""

    k: torch.Tensor
    thresholds: torch.Tensor
    codes: torch.Tensor
    slots: torch.Tensor


def quantize_pack_reference(x: torch.Tensor, thresholds: torch.Tensor, bits: int = 2,
                            transform: bool = True, append: PendingCodes | None = None) -> torch.Tensor:
    """(Hadamard if `transform`) + bucketize + pack: x [B, H, n, D] -> int16 words [B, H, n, W] (fp32 maths).
    `append`: a decode step's keys, coded into their buffer first. Contract of `codes.quantize_pack`."""
    if append is not None:
        quantize_pack_into_reference(append.k, append.thresholds, append.codes, append.slots, bits, transform)
    x = x.float()
    if transform:
        x = x @ hadamard_matrix(x.shape[-1], torch.float32, x.device)
    return code_pack_reference(code_bucketize_reference(x, thresholds, bits), bits)


def quantize_pack_into_reference(x: torch.Tensor, thresholds: torch.Tensor, out_words: torch.Tensor,
                                 start: int | torch.Tensor, bits: int = 2, transform: bool = True) -> None:
    """quantize_pack_reference written into out_words [B, H, Lmax, W] at [start, start + n): `start` an int, or for
    one token per row a device tensor [B]. Contract of `codes.quantize_pack_into`."""
    words = quantize_pack_reference(x, thresholds, bits, transform)
    if isinstance(start, int):
        out_words[:, :, start : start + x.shape[2]] = words
    else:
        out_words[torch.arange(out_words.shape[0], device=out_words.device), :, start.long()] = words[:, :, 0]


def code_scores_reference(q_words: torch.Tensor, k_words: torch.Tensor, length: int, d: int, bits: int = 2,
                          metric: str = "l1", *, pool: str | None = None) -> torch.Tensor:
    """Negated code distances fp32 [B, H, length] (higher = closer) of the first `length` keys: contract of
    `codes.code_scores`."""
    qw = q_words.reshape(q_words.shape[0], q_words.shape[1], -1)
    return -code_distance_reference(qw, k_words[:, :, :length], d, bits, metric, pool).float()


def head_top_reference(scores: torch.Tensor, kv_heads: int, m: int, keep: torch.Tensor | None = None,
                       ties: str = "low") -> torch.Tensor:
    """Each query head's m best keys, as a mask over its KV head's keys: bool [B, kv_heads, n] from per-query-head
    scores [B, Hq, n] (higher = better), ties as `ties`; only keys inside `keep` (bool, broadcastable to [B, 1, n])
    count, so a head with fewer allowed keys forces fewer. What `codes.code_topk(head_top=m)` chooses first."""
    B, Hq, n = scores.shape
    if Hq % kv_heads:
        raise ValueError(f"{Hq} query heads are not a multiple of {kv_heads} KV heads")
    s = scores.float()
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    idx = topk_reference(s, min(m, n), ties=ties)
    forced = torch.zeros(B, Hq, n, dtype=torch.bool, device=scores.device)
    forced.scatter_(-1, idx, torch.gather(s, -1, idx) > float("-inf"))
    return forced.view(B, kv_heads, Hq // kv_heads, n).any(2)


def code_ip_scores_reference(q: torch.Tensor, k_words: torch.Tensor, centers: torch.Tensor, length: int, d: int,
                             bits: int = 2, *, pool: str | None = None) -> torch.Tensor:
    """adamas_ip_scores_reference over the first `length` keys: contract of `codes.code_ip_scores`."""
    return adamas_ip_scores_reference(q.reshape(q.shape[0], q.shape[1], -1), k_words[:, :, :length], centers, d,
                                      bits, pool)


# ---------------------------------------------------------------------------------------------------------------
# Quest (Tang et al., ICML 2024): page upper bounds from the key-wise max and min of each page.


def quest_scores_reference(q: torch.Tensor, bounds: torch.Tensor, n_pages: int,
                           pool: str | None = "max") -> torch.Tensor:
    """Upper bounds fp32 [B, Hkv, n_pages] (pool "max" over each KV head's query group) or [B, Hq, n_pages] (None):
    U = Σ_i max(q_i·m_i, q_i·M_i) (Algorithm 1), >= q·k for every key k of the page.

    q: [B, Hq, D] or [B, Hq, 1, D]; bounds: [B, Hkv, >= n_pages, 2D], each page's max M then min m.
    """
    if q.dim() == 4:
        q = q[:, :, 0]
    B, Hq, D = q.shape
    Hkv = bounds.shape[1]
    hi = bounds[:, :, :n_pages, :D].float().repeat_interleave(Hq // Hkv, dim=1)  # [B, Hq, P, D], clarity over speed
    lo = bounds[:, :, :n_pages, D:].float().repeat_interleave(Hq // Hkv, dim=1)
    qf = q.float().unsqueeze(2)
    u = torch.maximum(qf * hi, qf * lo).sum(-1)
    if pool is None:
        return u
    if pool != "max":
        raise ValueError(f"pool must be None or 'max', got {pool!r}")
    return u.view(B, Hkv, Hq // Hkv, n_pages).amax(2)


@dataclass(frozen=True)
class PageRegion:
    """The pages a Quest step may choose, per batch row: page p overlaps the row's region [start + sink, length -
    window) (`rows`, a RowBounds; its lo unused), and is not the row's newest page, (length - 1) // page_size, when
    `skip_last` (that page is attended anyway). Pages are counted from p_lo (the first page scored)."""

    rows: RowBounds
    page_size: int
    p_lo: int = 0
    skip_last: bool = False

    def mask(self, n_pages: int) -> torch.Tensor:
        """bool [B, 1, n_pages]: which of the n_pages pages from p_lo each row may choose."""
        r, S = self.rows, self.page_size
        L = r.lengths.long().view(-1, 1, 1)
        start = window_start(L, r.span)
        page = self.p_lo + torch.arange(n_pages, device=L.device).view(1, 1, -1)
        ok = ((page + 1) * S > start + r.sink) & (page * S < L - r.window)
        return ok & (page != (L - 1) // S) if self.skip_last else ok


def quest_region_scores_reference(q: torch.Tensor, bounds: torch.Tensor, n_pages: int, pool: str | None = "max",
                                  region: PageRegion | None = None) -> torch.Tensor:
    """quest_scores_reference with the pages outside `region` at -inf (never chosen while others remain)."""
    u = quest_scores_reference(q, bounds, n_pages, pool)
    return u if region is None else u.masked_fill(~region.mask(n_pages), float("-inf"))


def quest_blocks_reference(scores: torch.Tensor, pick: torch.Tensor, region: PageRegion) -> torch.Tensor:
    """The pages a step attends, int64 [B, H, k (+ 1)]: the picked pages (indices into scores [B, H, n], from the
    top-k) as absolute pages, -1 where the pick is a -inf score (fewer choosable pages than k), then, when
    region.skip_last, each row's newest page."""
    chosen = torch.gather(scores, 2, pick) > float("-inf")
    blocks = torch.where(chosen, pick + region.p_lo, -1)
    if not region.skip_last:
        return blocks
    last = (region.rows.lengths.long().view(-1, 1, 1) - 1) // region.page_size
    return torch.cat((blocks, last.expand(blocks.shape[0], blocks.shape[1], 1)), dim=-1)


def quest_append_reference(bounds: torch.Tensor, k: torch.Tensor, pos: int | torch.Tensor, page_size: int) -> None:
    """One new key per row, k [B, Hkv, 1, D] at position pos (an int, or device slots [B]), folded into its page's
    [max | min] row of bounds [B, Hkv, pages, 2D] in place; the first key of a page replaces the row."""
    B, D = k.shape[0], k.shape[-1]
    pos = torch.as_tensor(pos, device=k.device).long().expand(B)
    rows, page = torch.arange(B, device=k.device), pos // page_size
    fresh = (pos % page_size == 0).view(B, 1, 1)
    k1 = k[:, :, 0].to(bounds.dtype)
    hi = torch.where(fresh, k1, torch.maximum(bounds[rows, :, page, :D], k1))
    lo = torch.where(fresh, k1, torch.minimum(bounds[rows, :, page, D:], k1))
    bounds[rows, :, page] = torch.cat((hi, lo), dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# A decode step's layer elementwise ops (kernels/layer_ops.py), eager transformers' arithmetic.

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(h) * weight, h), h = x + residual (or x): Llama's RMSNorm (fp32 statistics, weight applied after
    rounding back to the input dtype)."""
    h = x + residual if residual is not None else x
    h32 = h.float()
    y = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return weight * y, h


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, D] rotated by cos/sin [B, n, R] on its first R dims (the rest passes through), in fp32."""
    R = cos.shape[-1]
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    xr = x[..., :R].float()
    half = torch.cat((-xr[..., R // 2 :], xr[..., : R // 2]), dim=-1)
    return torch.cat(((xr * c + half * s).to(x.dtype), x[..., R:]), dim=-1)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]ᵀ + bias: a decode step's linear layer (kernels/gemv.py)."""
    return torch.nn.functional.linear(x, weight, bias)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def write_kv_reference(keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    rows = torch.arange(keys.shape[0], device=keys.device)
    keys[rows, :, slot.long()] = k[:, :, 0]
    values[rows, :, slot.long()] = v[:, :, 0]


def rope_write_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated (`rope_reference`), the rotated k and v written into keys/values at slot [B]
    (`write_kv_reference`) -> (q, k) rotated."""
    q, k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    write_kv_reference(keys, values, slot, k, v)
    return q, k


def pooled_log_probs_reference(logits: torch.Tensor, group: int, scale: float, softcap: float | None = None,
                               bounds: RowBounds | None = None) -> torch.Tensor:
    """logits [B, Hq, n] (unscaled q·k) -> log of softmax(logits x scale, softcapped, over each row's region
    `bounds` (every key when None)) per query head, summed over each run of `group` heads: [B, Hq // group, n] fp32
    (-inf where no head keeps the key). Contract of `exact_scores.pooled_log_probs`."""
    B, Hq, n = logits.shape
    s = logits.float() * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bounds is not None:
        s = s.masked_fill(~bounds.mask(n), float("-inf"))
    lp = torch.log_softmax(s, dim=-1).nan_to_num(float("-inf"), neginf=float("-inf"))
    return torch.logsumexp(lp.view(B, Hq // group, group, n), dim=2)


# ---------------------------------------------------------------------------------------------------------------
# Chunked causal prefill (kernels/prefill_attention.py).

def prefill_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                                span: int = 0, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the last n of L positions: q [B, Hq, n, D] over keys/values [B, Hkv, L, D] (L >= n) ->
    [B, Hq, n, D] in q's dtype. Query i sits at p = L - n + i and sees keys j <= p (and j > p - span when span > 0);
    query head h reads KV head h // (Hq // Hkv). Logits scale * q·k, or softcap * tanh(scale * q·k / softcap).

    fp32 maths over a block of query rows at a time, each against only the keys some row of it can see, so no n x L
    mask (nor n x L logits) is ever held: a long prompt's chunk stays within a fixed memory budget.
    """
    B, Hq, n, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    if L < n or Hq % Hkv:
        raise ValueError(f"prefill_attention: need L >= n and Hq a multiple of Hkv, got L={L}, n={n}, "
                         f"Hq={Hq}, Hkv={Hkv}")
    G = Hq // Hkv
    out = torch.empty(B, Hq, n, D, dtype=q.dtype, device=q.device)
    rows = max(1, min(1024, (1 << 26) // max(1, B * Hq * L)))  # at most 64M logits (256 MB) per block
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        pos = torch.arange(L - n + r0, L - n + r1, device=q.device)  # absolute positions of these queries
        lo = max(0, L - n + r0 - span + 1) if span else 0
        hi = L - n + r1  # one past the last key any row of the block sees
        j = torch.arange(lo, hi, device=q.device)
        keep = j[None, :] <= pos[:, None]
        if span:
            keep &= j[None, :] > pos[:, None] - span
        qg = q[:, :, r0:r1].float().reshape(B, Hkv, G, r1 - r0, D)
        s = torch.einsum("bhgrd,bhjd->bhgrj", qg, keys[:, :, lo:hi].float()) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("bhgrj,bhjd->bhgrd", p, values[:, :, lo:hi].float())
        out[:, :, r0:r1] = o.reshape(B, Hq, r1 - r0, D).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Spotlight Attention's MLP hash (§3.2 eq. 5-6): H(x) = sign(W2 · SiLU(W1 x + b1)), packed like 1-bit codes
# (kernels/hash_mlp.py).

def _mlp_hash_shapes(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                     w2: torch.Tensor | None) -> tuple[int, int, int]:
    """(Hkv, M, nbits) of the weights w1 [Hkv, D, M], b1 [Hkv, M], w2 [Hkv, M, nbits] (or of a linear hash: w1
    [Hkv, D, nbits] alone, M = 0), checked against x [B, H, n, D] with H a multiple of Hkv."""
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, n, D], got {tuple(x.shape)}")
    if (b1 is None) != (w2 is None):
        raise ValueError("give b1 and w2 together (an MLP hash), or neither (a linear hash)")
    if w2 is None:
        if w1.dim() != 3 or w1.shape[1] != x.shape[3] or w1.shape[2] < 1:
            raise ValueError(f"a linear hash's w1 must be [Hkv, {x.shape[3]}, nbits], got {tuple(w1.shape)}")
        Hkv, M, nbits = w1.shape[0], 0, w1.shape[2]
    else:
        if w1.dim() != 3 or b1.dim() != 2 or w2.dim() != 3:
            raise ValueError(f"expected w1 [Hkv, D, M], b1 [Hkv, M], w2 [Hkv, M, nbits]; got {tuple(w1.shape)}, "
                             f"{tuple(b1.shape)}, {tuple(w2.shape)}")
        Hkv, D, M = w1.shape
        nbits = w2.shape[2]
        if D != x.shape[3] or tuple(b1.shape) != (Hkv, M) or tuple(w2.shape[:2]) != (Hkv, M) or nbits < 1:
            raise ValueError(f"weights w1 {tuple(w1.shape)}, b1 {tuple(b1.shape)}, w2 {tuple(w2.shape)} do not fit "
                             f"x {tuple(x.shape)} (expected w1 [Hkv, D, M], b1 [Hkv, M], w2 [Hkv, M, nbits])")
    if Hkv == 0 or x.shape[1] % Hkv:
        raise ValueError(f"{x.shape[1]} heads of x are not a multiple of the weights' {Hkv} KV heads")
    return Hkv, M, nbits


def mlp_hash_reference(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None = None,
                       w2: torch.Tensor | None = None) -> torch.Tensor:
    """The hash's pre-sign outputs fp32 [B, H, n, nbits]: W2 · SiLU(W1 x + b1) (no b2), fp32 maths; without b1 and
    w2 the linear hash x @ w1 (w1 [Hkv, D, nbits]: LSH's hyperplanes).

    x [B, H, n, D] (any float dtype); w1 [Hkv, D, M], b1 [Hkv, M], w2 [Hkv, M, nbits] (fp32 or 16-bit); head h of x
    uses KV head h // (H // Hkv)'s weights (keys: H = Hkv; queries: a GQA group per KV head). Row-vector form:
    y = SiLU(x @ w1[kv] + b1[kv]) @ w2[kv]."""
    Hkv, M, nbits = _mlp_hash_shapes(x, w1, b1, w2)
    B, H, n, D = x.shape
    xf = x.float().reshape(B, Hkv, (H // Hkv) * n, D)  # a KV head's query group, rows (g, i)
    y = torch.einsum("bhrd,hdm->bhrm", xf, w1.float().to(x.device))
    if w2 is not None:
        hid = torch.nn.functional.silu(y + b1.float().to(x.device)[None, :, None, :])
        y = torch.einsum("bhrm,hmk->bhrk", hid, w2.float().to(x.device))
    return y.reshape(B, H, n, nbits)


@dataclass(frozen=True)
class PendingHash:
    """A decode step's key hash (mlp_hash_pack_into of k [B, Hkv, 1, D] into `codes` at device slots [B]) handed to
    the step's query hash, which carries it out first (the kernel: in the same launch)."""

    k: torch.Tensor
    codes: torch.Tensor
    slots: torch.Tensor


def query_care_reference(y: torch.Tensor, margin: float) -> torch.Tensor:
    """The bits of a ternary query that count: bool [..., nbits], |y| > margin · rms(y) over each row's bits, where
    y [..., nbits] are the hash's pre-sign values. A bit whose value lies near 0 is as likely flipped as not; a key
    matching or missing it says little, so it is left out of the distance."""
    y = y.float()
    return y.abs() > margin * y.pow(2).mean(-1, keepdim=True).sqrt()


def check_margin(margin: float | None) -> None:
    """A query margin is None (binary queries) or a finite number >= 0."""
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not 0 <= margin < float("inf")):
        raise ValueError(f"margin must be None or a finite number >= 0, got {margin!r}")


def mlp_hash_pack_reference(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None = None,
                            w2: torch.Tensor | None = None, append: PendingHash | None = None,
                            margin: float | None = None) -> torch.Tensor:
    """Spotlight's hash codes int16 [B, H, n, ceil(nbits / 16)]: bit j of the code = 1[mlp_hash_reference(x)_j > 0],
    packed as 1-bit codes (code_pack_reference, bits=1: bit j at position j % 16 of word j // 16, padding bits 0),
    i.e. quantize_pack_reference(y, thresholds (0,), bits=1, transform=False). Contract of
    `hash_mlp.mlp_hash_pack`; the codes' L1 distance with bits=1 (code_scores / code_topk) is their Hamming
    distance. `append`: a decode step's key hash, done first. `margin`: ternary codes [B, H, n, 2W], the sign
    words then the care words (query_care_reference(y, margin), packed the same way), which the code distances
    read as a query whose uncared bits count for no key."""
    check_margin(margin)
    if append is not None:
        mlp_hash_pack_into_reference(append.k, w1, b1, w2, append.codes, append.slots)
    y = mlp_hash_reference(x, w1, b1, w2)
    words = code_pack_reference((y > 0).to(torch.uint8), bits=1)
    if margin is None:
        return words
    return torch.cat([words, code_pack_reference(query_care_reference(y, margin).to(torch.uint8), bits=1)], -1)


def mlp_hash_pack_into_reference(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                                 w2: torch.Tensor | None, out_words: torch.Tensor,
                                 start: int | torch.Tensor, margin: float | None = None) -> None:
    """mlp_hash_pack_reference written into out_words [B, H, Lmax, W] (2W with `margin`) at rows [start, start + n):
    `start` an int, or a device tensor [B] of each batch row's first slot (one token per row at a decode step; no
    host read). Contract of `hash_mlp.mlp_hash_pack_into`."""
    words = mlp_hash_pack_reference(x, w1, b1, w2, margin=margin)
    if isinstance(start, int):
        out_words[:, :, start : start + x.shape[2]] = words
    else:
        rows = torch.arange(out_words.shape[0], device=out_words.device)[:, None]
        slots = start.to(device=out_words.device, dtype=torch.long)[:, None] + torch.arange(
            x.shape[2], device=out_words.device)
        out_words[rows, :, slots] = words.permute(0, 2, 1, 3)  # [B, n, H, W]


# ---------------------------------------------------------------------------------------------------------------
# SAAP's decode step (kernels/saap.py): a new key's bucket and the key leaving the window joining its list; the
# queries' bucket logits; the visited buckets' first slots; the positions of their keys, in CSR order.

def saap_append_reference(buckets: torch.Tensor, ordinals: torch.Tensor, counts: torch.Tensor,
                          centroids: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, sink: int, window: int,
                          newest_first: bool = False) -> None:
    """One decode step's keys k [B, Hkv, 1, D] at device positions pos [B], in place on the lists (sparsekv/saap/
    lists.py): each key's bucket, the argmax of its fp32 inner products with its KV head's centroids [Hkv, C, D]
    (ties to the lower bucket), is written at pos; the key `window` positions earlier, when at or past `sink`,
    joins its bucket's list: its ordinal is the list's length (stored -1 - length with `newest_first`), which grows
    by one."""
    rows = torch.arange(k.shape[0], device=k.device)
    new = (k[:, :, 0].float().unsqueeze(-2) @ centroids.float().transpose(-1, -2)).squeeze(-2).argmax(-1)
    p_new = pos.long()
    buckets[rows, :, p_new] = new.to(buckets.dtype)
    p = p_new - window
    ok = (p >= sink).view(-1, 1)
    p = p.clamp(min=0)
    b = buckets[rows, :, p].long()  # [B, Hkv]
    index = counts.gather(-1, b[:, :, None])[:, :, 0]
    ordinals[rows, :, p] = torch.where(ok, -1 - index if newest_first else index, ordinals[rows, :, p])
    counts.scatter_add_(-1, b[:, :, None], ok.to(counts.dtype).expand_as(b)[:, :, None].contiguous())


@dataclass(frozen=True)
class PendingAppend:
    """A decode step's `saap_append` (its arguments less the centroids) handed to `bucket_logits`, which carries it
    out first (the kernel: in the same launch)."""

    buckets: torch.Tensor
    ordinals: torch.Tensor
    counts: torch.Tensor
    k: torch.Tensor
    pos: torch.Tensor
    sink: int
    window: int
    newest_first: bool = False


def bucket_logits_reference(x: torch.Tensor, centroids: torch.Tensor, model: tuple | None = None,
                            append: PendingAppend | None = None, centroids_too: bool = False
                            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fp32 [B, Hq, C]: each query x [B, Hq, 1, D] scored against its KV head's C buckets: the folded Q-model's
    logits relu(x w1 + b1) w2 + b2 (model = (w1 [Hkv, D, M], b1 [Hkv, M], w2 [Hkv, M, C], b2 [Hkv, C])), else the
    inner products with the centroids [Hkv, C, D]. Products take their inputs in the weights' dtype (x and the
    hidden layer rounded to it, as tensor cores read them) and sum in fp32. `append`: a decode step's
    `saap_append_reference` with these centroids, done first. `centroids_too` (with a Q-model): the pair (its
    logits, the centroids' inner products), for `mixed_order`."""
    if append is not None:
        a = append
        saap_append_reference(a.buckets, a.ordinals, a.counts, centroids, a.k, a.pos, a.sink, a.window,
                              a.newest_first)
    B, Hq, _, D = x.shape
    Hkv, C, _ = centroids.shape
    dt = centroids.dtype if model is None else model[0].dtype
    xg = x.to(dt).float().reshape(B, Hkv, Hq // Hkv, D)
    if model is None:
        s = xg @ centroids.float().transpose(-1, -2)
    else:
        w1, b1, w2, b2 = (t.float() for t in model)
        h = torch.relu(xg @ w1 + b1.unsqueeze(-2)).to(dt).float()
        s = h @ w2 + b2.unsqueeze(-2)
    s = s.reshape(B, Hq, C)
    if centroids_too:
        if model is None:
            raise ValueError("bucket_logits: centroids_too pairs a Q-model's logits with the centroids'")
        return s, bucket_logits_reference(x, centroids)
    return s


def slot_bases(counts: torch.Tensor, chosen: torch.Tensor, newest_first: bool = False) -> torch.Tensor:
    """counts [B, Hs, C + 1] (the lists' lengths, per selection head) and the chosen buckets [B, Hs, l] (best
    first) -> int32 [B, Hs, C + 1]: each chosen bucket's first slot when the chosen lists are laid end to end in
    that order (`newest_first`: its first slot plus its length, for ordinals stored as -1 - index), -1 for the
    others (and for the sentinel C)."""
    cnt = counts.gather(-1, chosen)
    ends = cnt.cumsum(-1)
    base = torch.full_like(counts, -1)
    return base.scatter_(-1, chosen, (ends if newest_first else ends - cnt).to(base.dtype))


def bucket_rank_keys(scores: torch.Tensor) -> torch.Tensor:
    """int32 keys of fp32 scores [..., C] that order as the scores, ties to the lower bucket, in 32 bits: the scores'
    bits made order-preserving, their lowest log2(C) bits (rounded up to a power of two) replaced by the bucket's
    rank from the top. Scores equal in their sign, exponent and highest 23 - log2(C) mantissa bits count as a tie
    (relative 2^-13 at C = 1024): the bucket ranking sorts 32-bit keys, not 64."""
    C = scores.shape[-1]
    b = max(1, (C - 1).bit_length())
    bits = scores.float().contiguous().view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    low = (1 << b) - 1 - torch.arange(C, dtype=torch.int32, device=scores.device)
    return ((key >> b) << b) | low


def group_scores(scores: torch.Tensor, group: int, softmax: bool) -> torch.Tensor:
    """fp32 [B, Hq / group, C]: bucket scores [B, Hq, C] (`softmax`: each query head's distribution first) summed
    over each selection head's `group` query heads (SAAP's §5 "Batched queries")."""
    B, Hq, C = scores.shape
    s = torch.softmax(scores.float(), dim=-1) if softmax else scores.float()
    return s.view(B, Hq // group, group, C).sum(2)


def mix_factors(share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 factors 1 / (1 - share) and 1 / share that turn the two rankings' ranks into turns: a Triton kernel
    given them as floats rounds them to fp32 the same way, and multiplies as these do."""
    return torch.tensor(1 / (1 - share), dtype=torch.float32), torch.tensor(1 / share, dtype=torch.float32)


def _ranks(order: torch.Tensor) -> torch.Tensor:
    """int64 rank of each bucket [..., C] (0 the first) from `order`, the buckets best first."""
    idx = torch.arange(order.shape[-1], device=order.device).expand(order.shape)
    return torch.empty_like(order).scatter_(-1, order, idx.contiguous())


def mixed_order(scores: torch.Tensor, centroid_scores: torch.Tensor, group: int, softmax: bool,
                share: float) -> torch.Tensor:
    """int64 [B, Hq / group, C]: each selection head's buckets in the order two rankings give them taken in turn, a
    share `share` of the best ones from the second (SAAP's `centroid_share`; 0 < share < 1). Each ranking orders
    `group_scores` (of the Q-model's logits `scores`, and of the centroids' inner products `centroid_scores`, both
    [B, Hq, C]) by `bucket_rank_keys`. A bucket's turn is its better rank, each rank times its ranking's factor
    (`mix_factors`, fp32); equal turns go in the first ranking's order."""
    oq, oc = (bucket_rank_keys(group_scores(s, group, softmax)).argsort(dim=-1, descending=True)
              for s in (scores, centroid_scores))  # keys are distinct: one order
    fq, fc = (f.to(scores.device) for f in mix_factors(share))
    turn = torch.minimum(_ranks(oq).float() * fq, _ranks(oc).float() * fc)
    return oq.gather(-1, torch.argsort(turn.gather(-1, oq), dim=-1, stable=True))  # by turn, then the first's


def bucket_bases_reference(scores: torch.Tensor, counts: torch.Tensor, probes: int, group: int = 1,
                           softmax: bool = False, newest_first: bool = False,
                           centroid_scores: torch.Tensor | None = None, centroid_share: float = 0.0) -> torch.Tensor:
    """int32 [B, Hs, C + 1], Hs = Hq / group: the `probes` best buckets of each selection head, their lists laid end
    to end best first (`slot_bases`). scores [B, Hq, C] (fp32 logits; `softmax`: each query head's distribution
    first), summed over each selection head's `group` query heads (SAAP's §5 "Batched queries"); the best are the
    highest sums as `bucket_rank_keys` orders them. With `centroid_scores` and a `centroid_share` in (0, 1), the
    best are the first of `mixed_order` instead. counts [B, Hkv, C + 1]: selection head h reads KV head
    h // (Hs / Hkv)."""
    if centroid_share:
        chosen = mixed_order(scores, centroid_scores, group, softmax, centroid_share)[..., :probes]
    else:
        chosen = bucket_rank_keys(group_scores(scores, group, softmax)).topk(probes, dim=-1).indices  # distinct keys
    per = chosen.shape[1] // counts.shape[1]
    return slot_bases(counts.repeat_interleave(per, dim=1) if per > 1 else counts, chosen, newest_first)


def bucket_gather_reference(buckets: torch.Tensor, ordinals: torch.Tensor, bases: torch.Tensor, cap: int, lo: int,
                            hi: int, bounds: RowBounds | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [B, Hs, cap], how many of its slots hold a key, summed over rows and heads, 0-dim int32): the key at
    position p in [lo, hi) (and in its row's region when `bounds` gives the rows' device lengths: RowBounds, its
    `lo` unused) whose bucket b = buckets[.., p] has bases[.., b] >= 0 goes to slot bases[.., b] + ordinals[.., p]
    when that is below `cap`; the other slots hold -1. buckets/ordinals [B, Hkv, Lmax] (int; sentinel buckets index
    the last column of bases), bases [B, Hs, C + 1] (Hs = Hkv, or Hq: query head h reads KV head h // (Hs // Hkv)).
    Slots are unique by construction (a bucket's keys have distinct ordinals), so the result is deterministic."""
    out = _bucket_gather(buckets, ordinals, bases, cap, lo, hi, bounds)
    return out, out.ge(0).sum().to(torch.int32)


def bucket_select_reference(scores: torch.Tensor, counts: torch.Tensor, buckets: torch.Tensor,
                            ordinals: torch.Tensor, probes: int, group: int, softmax: bool, newest_first: bool,
                            cap: int, lo: int, hi: int, bounds: RowBounds | None = None,
                            centroid_scores: torch.Tensor | None = None, centroid_share: float = 0.0
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """SAAP's selection from the bucket logits: `bucket_bases_reference` then `bucket_gather_reference` (same
    arguments, same result)."""
    bases = bucket_bases_reference(scores, counts, probes, group, softmax, newest_first, centroid_scores,
                                   centroid_share)
    return bucket_gather_reference(buckets, ordinals, bases, cap, lo, hi, bounds)


def _bucket_gather(buckets: torch.Tensor, ordinals: torch.Tensor, bases: torch.Tensor, cap: int, lo: int, hi: int,
                   bounds: RowBounds | None) -> torch.Tensor:
    B, Hkv, _ = buckets.shape
    Hs = bases.shape[1]
    out = torch.full((B, Hs, cap + 1), -1, dtype=torch.int64, device=buckets.device)
    if hi <= lo or cap <= 0:
        return out[..., :cap]
    kv = torch.arange(Hs, device=buckets.device) // (Hs // Hkv)
    bk = buckets[:, kv, lo:hi].long()
    base = bases.long().gather(-1, bk)
    slot = base + ordinals[:, kv, lo:hi].long()
    pos = torch.arange(lo, hi, device=buckets.device).view(1, 1, -1)
    ok = (base >= 0) & (slot < cap)
    if bounds is not None:
        ok &= replace(bounds, lo=lo).mask(hi - lo)
    out.scatter_(-1, torch.where(ok, slot, cap), pos.expand(B, Hs, -1))  # slot `cap` takes the rest, then goes
    return out[..., :cap]
