"""Passkey retrieval (Mohtashami & Jaggi 2023; the protocol of Quest/Adamas): a 5-digit key hidden at a given
depth inside repeated filler text; the model must repeat it. Score = % of samples whose answer contains the key.
"""

from __future__ import annotations

import random

from ..errors import SparseKVError
from .prompts import build_prompt
from .sample import Sample

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"
GEN_TOKENS = 10



def depths(n: int, n_depths: int = 10) -> list[float]:
    """Sample i sits at depth (i mod d)/(d-1), d = min(n, n_depths): evenly spread from start to end."""
    d = max(1, min(n, n_depths))
    return [((i % d) / (d - 1)) if d > 1 else 0.5 for i in range(n)]


def _text(n_filler: int, depth: float, key: str) -> str:
    at = round(depth * n_filler)
    parts = [FILLER] * n_filler
    parts.insert(at, NEEDLE.format(key=key))
    return " ".join([INTRO, *parts, QUESTION])


def make_sample(tokenizer, seq_len: int, depth: float, key: str) -> Sample:
    """The largest prompt of at most `seq_len` tokens (prompt only; the answer is generated past it)."""
    ids0, _ = build_prompt(tokenizer, _text(0, depth, key), ANSWER_PREFIX)
    ids1, _ = build_prompt(tokenizer, _text(1, depth, key), ANSWER_PREFIX)
    per = max(1, len(ids1) - len(ids0))
    if len(ids0) > seq_len:
        raise SparseKVError(f"seq {seq_len} is too short for a passkey prompt (needs > {len(ids0)} tokens)")
    n = (seq_len - len(ids0)) // per + 1
    while n > 0:  # the estimate can overshoot by a token or two at boundaries: step down until it fits
        ids, template = build_prompt(tokenizer, _text(n, depth, key), ANSWER_PREFIX)
        if len(ids) <= seq_len:
            return Sample(ids, key, depth, template, GEN_TOKENS)
        n -= 1
    ids, template = build_prompt(tokenizer, _text(0, depth, key), ANSWER_PREFIX)
    return Sample(ids, key, depth, template, GEN_TOKENS)


def make_samples(tokenizer, seq_len: int, n: int, seed: int = 42) -> list[Sample]:
    rng = random.Random(seed)
    return [make_sample(tokenizer, seq_len, d, str(rng.randint(10000, 99999))) for d in depths(n)]
