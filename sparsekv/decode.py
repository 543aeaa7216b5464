"""Prefill and greedy decoding through a SparseCache: the loop every online command shares.

A hand-written loop rather than `generate()`: we own the cache, the position counter and the per-step
statistics, and the protocol is explicit (dense prefill of the whole prompt, the method on every decode step,
each new token indexed as it is appended).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import SparseCache
from .errors import SparseKVError
from .methods.base import Method
from .models import LoadedModel
from .rope import find_rotary


@dataclass
class Generation:
    tokens: list[int]  # generated token ids (prompt excluded)
    text: str
    prompt_tokens: int
    stats: dict = field(default_factory=dict)
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, when asked for


def make_cache(lm: LoadedModel, method: Method, max_len: int, dense_layers=()) -> SparseCache:
    rotary = find_rotary(lm.model) if method.needs_pre_rope else None
    return SparseCache(method, lm.num_layers, lm.q_heads, max_len, dense_layers=dense_layers, rotary=rotary)


@torch.no_grad()
def generate(lm: LoadedModel, input_ids: torch.Tensor | list[int], method: Method, max_new_tokens: int,
             dense_layers=(), stop_on_eos: bool = True, keep_logits: bool = False,
             prefill_chunk: int | None = None) -> Generation:
    """Greedy decode `max_new_tokens` after a dense prefill of `input_ids` (batch 1)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).view(1, -1).to(lm.device)
    n = ids.shape[1]
    if n == 0:
        raise SparseKVError("empty prompt")
    if lm.max_context and n + max_new_tokens > lm.max_context:
        raise SparseKVError(f"prompt ({n} tokens) + {max_new_tokens} new tokens exceed the model's context "
                            f"({lm.max_context} tokens)")
    cache = make_cache(lm, method, n + max_new_tokens, dense_layers)
    chunk = prefill_chunk or n
    for s in range(0, n, chunk):
        part = ids[:, s : s + chunk]
        pos = torch.arange(s, s + part.shape[1], device=ids.device).unsqueeze(0)
        logits = lm.model(input_ids=part, past_key_values=cache, position_ids=pos, use_cache=True,
                          logits_to_keep=1).logits[:, -1]
    eos = _eos_ids(lm) if stop_on_eos else set()
    out, kept = [], []
    for step in range(max_new_tokens):
        if keep_logits:
            kept.append(logits[0].float().cpu())
        nxt = int(logits[0].argmax())
        out.append(nxt)
        if nxt in eos or step == max_new_tokens - 1:
            break
        pos = torch.tensor([[n + step]], device=ids.device)
        logits = lm.model(input_ids=torch.tensor([[nxt]], device=ids.device), past_key_values=cache,
                          position_ids=pos, use_cache=True).logits[:, -1]
    text = lm.tokenizer.decode(out, skip_special_tokens=True)
    return Generation(out, text, n, cache.stats.summary(), kept)


def _eos_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    for src in (getattr(lm.tokenizer, "eos_token_id", None), getattr(lm.config, "eos_token_id", None),
                getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids
