"""Perplexity under sparse decoding: the PG19 protocol of Adamas (Fig. 4) and RADAR (Sec. 3.1).

Each window of `seq_len` tokens is split into a prompt of `prefill` tokens, prefilled densely once (prefill is
dense whatever the method, so every method decodes from the same K/V), and a continuation of `seq_len - prefill`
tokens that is fed token by token (teacher forcing) through a SparseCache running the method: every decode step
attends only what the method selects, and every fed token is indexed as it is appended. The logits at the last
prompt position predict the first continuation token. Perplexity = exp(total NLL / total scored tokens) over all
windows; only continuation tokens are scored.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import torch

from ..activations import text_tokens
from ..decode import prefill as dense_prefill
from ..decode import score_continuation
from ..errors import SparseKVError
from ..jsonio import device_label
from ..methods import get_method
from ..models import LoadedModel
from .result import CellResult, decode_fields, decode_means, tokenizer_name
from .runner import RunSpec, check_seq, check_specs

PROTOCOL = ("perplexity by teacher-forced token-by-token decoding (PG19 protocol of Adamas / RADAR): each window of "
            "seq_len tokens gets a dense prefill of its first `prefill` tokens, then the remaining seq_len - prefill "
            "ground-truth tokens are fed one at a time with the method selecting keys at every decode step and each "
            "fed token indexed as it is appended (query-aware, not query-agnostic compression); the logits at the "
            "last prefill position predict the first scored token; ppl = exp(total NLL / scored tokens) over all "
            "windows")


def ppl_tokens(lm: LoadedModel, text_file: str | Path | None = None, dataset: str | None = None,
               want: int = 4096) -> list[int]:
    """The first `want` token ids of a text file (.gz too) or a dataset's test split ("pg19" is emozilla/pg19, the
    parquet mirror of deepmind/pg19; documents are joined with EOS, the first book first). One clear
    SparseKVError line when the text is short or the dataset cannot be read (e.g. no hub access)."""
    return text_tokens(lm, text_file=text_file, dataset=dataset, tokens=want)


def prefill_len(seq_len: int, prefill: int | None = None) -> int:
    """Tokens prefilled densely before the scored ones: `prefill`, by default half the window."""
    p = seq_len // 2 if prefill is None else prefill
    if not 0 < p < seq_len:
        raise SparseKVError(f"--prefill must be in (0, {seq_len}) for seq {seq_len}, got {p}")
    return p


def with_dense_score(results: list[dict]) -> list[dict]:
    """Every cell gets `dense_score`, the dense perplexity at its length (None where dense did not run): sparse
    perplexity is read against it."""
    dense = {r["seq_len"]: r["score"] for r in results if r["method"] == "dense"}
    for r in results:
        r["dense_score"] = dense.get(r["seq_len"])
    return results


def check_ppl_args(lm: LoadedModel, specs: list[RunSpec], n_tokens: int, seq_len: int, prefill: int, n: int) -> None:
    """Every argument problem as one SparseKVError line, before any model work."""
    if seq_len < 2:
        raise SparseKVError(f"seq must be at least 2 tokens, got {seq_len}")
    if not 1 <= prefill < seq_len:
        raise SparseKVError(f"prefill must be between 1 and seq - 1 ({seq_len - 1}), got {prefill}")
    if n < 1:
        raise SparseKVError(f"n (windows) must be positive, got {n}")
    if n_tokens < n * seq_len:
        raise SparseKVError(f"perplexity over {n} window(s) of {seq_len} tokens needs {n * seq_len} tokens; "
                            f"the text has {n_tokens}")
    check_seq(lm, seq_len, 0)
    check_specs(specs, seq_len)


def ppl_grid(lm: LoadedModel, specs: list[RunSpec], token_ids: list[int] | torch.Tensor, seq_len: int, prefill: int,
             n: int = 1, dense_layers=(), on_step: Callable[[], object] | None = None,
             text_source: str = "") -> list[dict]:
    """Perplexity of every spec on the same `n` windows (the first n * seq_len tokens, back to back).

    Window-major: each window is prefilled once and every method decodes from that prefill. `on_step()` is called
    once per scored token per method: n * len(specs) * (seq_len - prefill) calls in all.
    Returns one result dict per spec (JSON-ready), in the shape of `runner.run_grid`'s.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
    check_ppl_args(lm, specs, ids.numel(), seq_len, prefill, n)
    methods = [get_method(sp.method, budget=sp.budget or 1.0, **sp.method_options) for sp in specs]
    nll = [[0.0] * n for _ in specs]
    stats: list[list[dict]] = [[] for _ in specs]
    seconds = [0.0] * len(specs)
    scored = seq_len - prefill
    for w in range(n):
        window = ids[w * seq_len : (w + 1) * seq_len]
        t0 = time.perf_counter()
        pf = dense_prefill(lm, window[:prefill], room=len(window) - prefill)
        shared = (time.perf_counter() - t0) / len(specs)  # prefill time, split evenly over the cells
        for i, method in enumerate(methods):
            t1 = time.perf_counter()
            total, _, st = score_continuation(lm, method, pf, window[prefill:], dense_layers, on_step)
            seconds[i] += time.perf_counter() - t1 + shared
            nll[i][w] = total
            stats[i].append(st)
    return [_result(lm, spec, m, seq_len, prefill, n, dense_layers, text_source, window_nll, st, sec, scored)
            for spec, m, window_nll, st, sec in zip(specs, methods, nll, stats, seconds)]


def _result(lm, spec, method, seq_len, prefill, n, dense_layers, text_source, window_nll, totals, seconds,
            scored) -> dict:
    nll = sum(window_nll) / (scored * n)  # mean NLL per scored token, nats
    return CellResult(
        task="ppl", metric="perplexity", score=math.exp(nll), method=spec.method, method_config=method.config(),
        budget=spec.budget, seq_len=seq_len, n=n, decode=decode_means(totals), model=lm.name, model_source=lm.source,
        artifact=spec.method_options.get("artifact"),
        seed=None,  # deterministic: windows are the first n * seq_len tokens
        protocol=PROTOCOL, device=device_label(lm.device), seconds=seconds, dense_layers=list(dense_layers),
        measures={"nll": nll},
        task_fields={"prefill": prefill, "tokens_scored": scored * n, **decode_fields(lm, totals),
                     "tokenizer": tokenizer_name(lm), "text_source": text_source,
                     "per_window": [{"window": w, "ppl": math.exp(v / scored)} for w, v in enumerate(window_nll)]},
    ).to_json()
