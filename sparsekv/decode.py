"""Prefill and greedy decoding through a SparseCache: the loop every online command shares.

A hand-written loop rather than `generate()`: we own the cache, the position counter and the per-step
statistics, and the protocol is explicit (dense prefill of the whole prompt, the method on every decode step,
each new token indexed as it is appended).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .cache import SparseCache
from .errors import SparseKVError
from .methods.base import Method
from .models import LoadedModel, cache_kwarg
from .rope import find_rotary
from .step import make_step


@dataclass
class Generation:
    tokens: list[int]  # generated token ids (prompt excluded)
    text: str
    prompt_tokens: int
    stats: dict = field(default_factory=dict)
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, when asked for
    timing: dict = field(default_factory=dict)  # first_step_s, steady_steps, steady_ms_per_step (_StepClock)


@dataclass
class Prefill:
    """A dense prefill, kept so several methods can decode from it without paying for it again (prefill is
    dense whatever the method, so the K/V are identical; each method indexes them when it loads them).

    Its K/V buffers have `room` slots past the prompt: a generation of up to `room` tokens decodes in them, with no
    copy of the prompt's K/V (each writes only past the prompt, so the next method finds the prompt intact)."""

    ids: torch.Tensor  # [1, n]
    key_buffers: list[torch.Tensor]  # per layer [1, Hkv, n + room, D]; the first n hold the prompt's keys
    value_buffers: list[torch.Tensor]
    logits: torch.Tensor  # [1, vocab] at the last prompt position

    @property
    def room(self) -> int:
        return self.key_buffers[0].shape[2] - self.ids.shape[1]

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer [1, Hkv, n, D]: the prompt's keys."""
        return [k[:, :, : self.ids.shape[1]] for k in self.key_buffers]

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[:, :, : self.ids.shape[1]] for v in self.value_buffers]


# Triton specialises integer kernel arguments on divisibility by 16, and a replayed step's grids and strides derive
# from the cache's slots: capacities in one class compile each kernel once, where a generation whose capacity fell in
# the other class compiled them again in its first step (seconds at 32768 tokens; BENCHMARKS.md)
SLOT_ALIGN = 16


def make_cache(lm: LoadedModel, method: Method, max_len: int, dense_layers=(),
               prefilled: Prefill | None = None) -> SparseCache:
    """A cache for `method`; with `prefilled` whose buffers hold max_len slots, it decodes in them (no copy).
    A new cache's slots are rounded up to a multiple of SLOT_ALIGN."""
    rotary = find_rotary(lm.model) if method.needs_pre_rope else None
    method.bind(lm)
    kv = None
    if prefilled is not None and prefilled.key_buffers[0].shape[2] >= max_len:
        kv = list(zip(prefilled.key_buffers, prefilled.value_buffers))
        max_len = prefilled.key_buffers[0].shape[2]
    else:
        max_len = -(-max_len // SLOT_ALIGN) * SLOT_ALIGN
    return SparseCache(method, lm.num_layers, lm.q_heads, max_len, dense_layers=dense_layers, rotary=rotary,
                       patterns=lm.patterns, kv=kv)


def _prompt(lm: LoadedModel, input_ids, max_new_tokens: int) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long).view(1, -1).to(lm.device)
    if ids.shape[1] == 0:
        raise SparseKVError("empty prompt")
    if lm.max_context and ids.shape[1] + max_new_tokens > lm.max_context:
        raise SparseKVError(f"prompt ({ids.shape[1]} tokens) + {max_new_tokens} new tokens exceed the model's "
                            f"context ({lm.max_context} tokens)")
    return ids


def _run_prefill(lm: LoadedModel, ids: torch.Tensor, cache: SparseCache, chunk: int | None) -> torch.Tensor:
    n = ids.shape[1]
    chunk = chunk or n
    for s in range(0, n, chunk):
        part = ids[:, s : s + chunk]
        pos = torch.arange(s, s + part.shape[1], device=ids.device).unsqueeze(0)
        logits = lm.model(input_ids=part, **cache_kwarg(lm.model, cache), position_ids=pos, use_cache=True,
                          logits_to_keep=1).logits[:, -1]
    return logits


@torch.no_grad()
def prefill(lm: LoadedModel, input_ids, prefill_chunk: int | None = None, room: int = 0) -> Prefill:
    """Dense prefill of a prompt, reusable by `generate(..., prefilled=...)` for any number of methods; `room`: the
    tokens a generation from it may add without copying the prompt's K/V (Prefill)."""
    from .methods import get_method

    ids = _prompt(lm, input_ids, room)
    cache = make_cache(lm, get_method("dense"), ids.shape[1] + room)
    logits = _run_prefill(lm, ids, cache, prefill_chunk)
    out = Prefill(ids, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], logits)
    cache.release()  # the buffers now live as long as the Prefill does, no longer
    return out


def _load_prefill(cache: SparseCache, prefilled: Prefill) -> torch.Tensor:
    """Load a shared dense prefill into `cache`: each layer's update indexes it exactly as a prefill would.
    Returns the logits at the last prompt position."""
    for i, (k, v) in enumerate(zip(prefilled.keys, prefilled.values)):
        cache.update(k, v, i)
    return prefilled.logits


@torch.no_grad()
def generate(lm: LoadedModel, input_ids: torch.Tensor | list[int] | None, method: Method, max_new_tokens: int,
             dense_layers=(), stop_on_eos: bool = True, keep_logits: bool = False,
             prefill_chunk: int | None = None, prefilled: Prefill | None = None) -> Generation:
    """Greedy decode `max_new_tokens` after a dense prefill of `input_ids` (batch 1), or from `prefilled`."""
    ids = _prompt(lm, prefilled.ids if prefilled is not None else input_ids, max_new_tokens)
    n = ids.shape[1]
    cache = make_cache(lm, method, n + max_new_tokens, dense_layers, prefilled)
    if prefilled is None:
        logits = _run_prefill(lm, ids, cache, prefill_chunk)
    else:
        logits = _load_prefill(cache, prefilled)
    cache.fix_budget()
    eos = _eos_ids(lm) if stop_on_eos else set()
    outs, kepts, timing = _greedy_loop(make_step(lm, cache), cache, logits, [n], [max_new_tokens], eos, keep_logits)
    out, kept = outs[0], kepts[0]
    text = lm.tokenizer.decode(out, skip_special_tokens=True)
    stats = cache.stats.summary()
    cache.release()
    return Generation(out, text, n, stats, kept, timing)


@torch.no_grad()
def generate_batch(lm: LoadedModel, prompts: list | None, method: Method, max_new_tokens: int | list[int],
                   dense_layers=(), stop_on_eos: bool = True, prefill_chunk: int | None = None,
                   prefilled: list[Prefill] | None = None, keep_logits: bool = False) -> list[Generation]:
    """Greedy decoding of several prompts of any lengths at once: each is prefilled (or taken from `prefilled`) and
    indexed alone, as `generate` does, then all rows decode in one batched step, each at its own position
    (SparseCache.load_row; one CUDA graph per step on a GPU). `max_new_tokens`: one for all, or one per prompt.

    Each row attends the keys its own `generate` would (a row whose context is within the budget reads every key;
    the float sums may run in another order). A fractional budget is resolved against the longest prompt: the rows
    of a batch share one k."""
    pfs = list(prefilled) if prefilled is not None else [prefill(lm, p, prefill_chunk) for p in prompts or []]
    if not pfs:
        raise SparseKVError("no prompts to generate from")
    B = len(pfs)
    limits = [max_new_tokens] * B if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != B:
        raise SparseKVError(f"{len(limits)} max_new_tokens for {B} prompts")
    if B == 1:
        return [generate(lm, None, method, limits[0], dense_layers, stop_on_eos, keep_logits, prefilled=pfs[0])]
    n = [_prompt(lm, pf.ids, limit).shape[1] for pf, limit in zip(pfs, limits)]
    cache = make_cache(lm, method, max(n) + max(limits), dense_layers)  # finished rows step on until the last
    logits = []
    for b, pf in enumerate(pfs):
        one = make_cache(lm, method, n[b] + pf.room, dense_layers, pf)
        logits.append(_load_prefill(one, pf))
        cache.load_row(b, B, one)
        one.release()
    logits = torch.cat(logits)
    cache.fix_budget()
    eos = _eos_ids(lm) if stop_on_eos else set()
    out, kept, timing = _greedy_loop(make_step(lm, cache), cache, logits, n, limits, eos, keep_logits)
    stats = cache.stats.summary()
    cache.release()
    return [Generation(o, lm.tokenizer.decode(o, skip_special_tokens=True), a, dict(stats), k, dict(timing))
            for o, a, k in zip(out, n, kept)]


def _greedy_loop(step_fn, cache: SparseCache, logits: torch.Tensor, start: list[int], limits: list[int],
                 eos: set[int], keep_logits: bool) -> tuple[list[list[int]], list[list[torch.Tensor]], dict]:
    """Greedy decoding of every row from `logits` [B, vocab] (each row's prompt ends at start[b] - 1; row b keeps at
    most limits[b] tokens, and stops early at an EOS id): the tokens and kept logits per row, and the step clock.

    Each token is picked on the device and fed to the next step there. Where steps run asynchronously (a GPU), the
    step that makes token t + 1 is queued before the host waits for token t, so the GPU does not stand idle while the
    host reads a token, checks it and launches the next step: on an H200 that wait cost 0.14-0.40 ms a token at
    131072 tokens of Llama-3-8B's shape, 4 % of dense's step (benchmarks/BENCHMARKS.md, "The host off the decode
    path"). A generation that stops at an EOS has then queued one step too many: it runs, but its statistics are
    taken back. On the CPU each step runs when called, so none runs ahead."""
    B = len(start)
    single = B == 1  # one row: its position by value (no per-step position tensor to copy over)
    ahead = _runs_ahead(logits.device)
    feed = _TokenFeed(logits.device, B)
    out: list[list[int]] = [[] for _ in range(B)]
    kept: list[list[torch.Tensor]] = [[] for _ in range(B)]
    done = [False] * B
    clock = _StepClock()
    pending, nxt = feed.pick(logits, keep_logits)  # token 0, from the prompt's logits
    total = max(limits)
    for t in range(total):
        queued, mark = None, None  # the pick of the step queued ahead, the statistics before it
        if ahead and 0 < t < total - 1:  # token 0 is read first, so the clock's first step is step 1 alone
            # only an EOS can end the generation before that step's token is needed: then the totals before it
            # are restored (the limits alone end it at t = total - 1, where no step is queued)
            mark = cache.stats.checkpoint() if eos else None
            queued = feed.pick(step_fn(nxt.view(B, 1), _at(start, t, single)), keep_logits)
        tokens, logit_rows = feed.read(pending)
        clock.tick()
        for b, tok in enumerate(tokens):
            if not done[b]:
                out[b].append(tok)
                if keep_logits:
                    kept[b].append(logit_rows[b])
                done[b] = tok in eos or len(out[b]) == limits[b]
        if all(done):
            if mark is not None:  # a step queued for a token nobody will read
                cache.stats.restore(mark)
            break
        if queued is None:
            queued = feed.pick(step_fn(nxt.view(B, 1), _at(start, t, single)), keep_logits)
        pending, nxt = queued
    if feed.cuda:  # nothing of this generation still runs once it returns (its cache and graphs are freed next)
        torch.cuda.current_stream(logits.device).synchronize()
    return out, kept, clock.summary()


def _runs_ahead(device: torch.device) -> bool:
    """Whether the decode loop queues a step before it reads the token before it: where steps run asynchronously."""
    return device.type == "cuda"


def _at(start: list[int], t: int, single: bool) -> int | list[int]:
    """The position at which token t is fed: one int for a single row, else one per row."""
    return start[0] + t if single else [a + t for a in start]


class _TokenFeed:
    """The greedy pick of each step, on the device, and its copy to the host. On a GPU the copy goes to one of two
    pinned buffers behind the step's work and an event marks it, so reading token t waits for that token alone
    (the step after it may already be queued); the pick itself stays on the device as the next step's input."""

    def __init__(self, device: torch.device, batch: int):
        self.cuda = device.type == "cuda"
        self.buffers = [torch.empty(batch, dtype=torch.long, pin_memory=True) for _ in range(2)] if self.cuda else []
        self.turn = 0

    def pick(self, logits: torch.Tensor, keep_logits: bool):
        """(the handle `read` takes, the tokens [B] on the device) of logits [B, vocab]. The logits may be a step's
        output buffer, which the next step overwrites, so kept logits are copied now."""
        nxt = greedy(logits)
        rows = logits.to(torch.float32, copy=True) if keep_logits else None
        if not self.cuda:
            return (nxt, None, rows), nxt
        buf = self.buffers[self.turn]
        self.turn ^= 1
        buf.copy_(nxt, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return (buf, event, rows), nxt

    @staticmethod
    def read(handle) -> tuple[list[int], list[torch.Tensor] | None]:
        tokens, event, rows = handle
        if event is not None:
            event.synchronize()
        return tokens.tolist(), (list(rows.cpu()) if rows is not None else None)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The greedy next token of each row of logits [B, V]: `logits.argmax(-1)`, the first of equal maxima (NaN
    counts as the largest, as there), in two reductions. On a GPU torch's argmax of one long row uses few threads:
    26.7 µs over Llama-3's 128256 bf16 logits on an H200, for every generated token. Taking the maximum of each run
    of up to 1024 logits first spreads the work over the GPU: 11.4 µs (benchmarks/BENCHMARKS.md, "Flash-decoding's
    tiles")."""
    B, V = logits.shape
    run = 1 << min(10, (V & -V).bit_length() - 1)  # the largest power of two <= 1024 dividing V
    if run < 64 or V <= run:
        return logits.argmax(-1)
    best, where = logits.reshape(B, V // run, run).max(-1)
    top = best.argmax(-1, keepdim=True)
    return top.squeeze(-1) * run + where.gather(-1, top).squeeze(-1)


class _StepClock:
    """Wall time of the decode steps, read where the loop already waits for each token on the host: the first step
    (on a GPU it compiles and captures the step's graph) apart from the steady ones after it."""

    def __init__(self):
        self.marks: list[float] = []

    def tick(self) -> None:
        self.marks.append(time.perf_counter())

    def summary(self) -> dict:
        m = self.marks
        steady = len(m) - 2  # marks: after the prefill, after step 1, after each later step
        return {"first_step_s": m[1] - m[0] if len(m) > 1 else None,
                "steady_steps": max(steady, 0),
                "steady_ms_per_step": 1e3 * (m[-1] - m[1]) / steady if steady > 0 else None}


@torch.no_grad()
def score_continuation(lm: LoadedModel, method: Method, prefilled: Prefill, targets: list[int] | torch.Tensor,
                       dense_layers=(), on_step: Callable[[], object] | None = None) -> tuple[float, int, dict]:
    """Teacher-forced scoring of `targets` after a dense prefill, with `method` on every decode step.

    The logits at the last prefill position predict targets[0]; then each target is fed one token at a time through
    the SparseCache (so every step's attention uses the method's selection and every fed token is indexed as it is
    appended) and the next logits predict the next target. The last target is scored but not fed.
    Returns (sum of the targets' negative log-likelihoods in nats, number of targets, the cache's decode stats).
    `on_step()` is called once per scored target.
    """
    tgt = torch.as_tensor(targets, dtype=torch.long).flatten().to(lm.device)
    T = tgt.numel()
    if T == 0:
        raise SparseKVError("no target tokens to score")
    ids = _prompt(lm, prefilled.ids, T - 1)  # the last target is never fed: T - 1 positions after the prompt
    n = ids.shape[1]
    cache = make_cache(lm, method, n + T - 1 if T > 1 else n, dense_layers, prefilled)
    logits = _load_prefill(cache, prefilled)
    cache.fix_budget()
    nll = torch.zeros((), dtype=torch.float64, device=ids.device)  # summed on the device: no sync per step
    step_fn = make_step(lm, cache)
    for i in range(T):
        nll -= torch.log_softmax(logits[0].float(), dim=-1)[tgt[i]].double()
        if on_step:
            on_step()
        if i == T - 1:
            break
        logits = step_fn(tgt[i].view(1, 1), n + i)
    stats = cache.stats.summary()
    cache.release()
    return float(nll), T, stats


def _eos_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    for src in (getattr(lm.tokenizer, "eos_token_id", None), getattr(lm.config, "eos_token_id", None),
                getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids
