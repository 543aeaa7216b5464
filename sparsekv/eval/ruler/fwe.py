"""Frequent words extraction (RULER scripts/data/synthetic/freq_words_extraction.py): random 6-letter "coded" words
with Zipf (zeta, alpha=2) counts; the most frequent one is replaced by '...' (noise) and the next three are the
references. The vocabulary has (seq_len - tokens_to_generate) // 50 words, as in RULER.

Deviation: RULER grows the word count in steps of max_len/32 (so prompts can fall up to ~3% short); we search it
exactly like every other subtask.
"""

from __future__ import annotations

import random
import string

from .base import Generator, Rendered, fill, shuffled, joined
from .config import CONFIGS, TEMPLATES

CODED_WORDLEN = 6  # --coded_wordlen default


def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta (scipy.special.zeta in RULER): a partial sum plus the Euler-Maclaurin tail."""
    n = terms
    return (sum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + n ** -alpha / 2
            + alpha * n ** (-alpha - 1) / 12)


class FreqWords(Generator):
    def __init__(self, name: str, seq_len: int):
        cfg = CONFIGS[name]
        t = TEMPLATES["freq_words_extraction"]
        self.name, self.alpha = name, cfg["alpha"]
        self.tokens_to_generate = t["tokens_to_generate"]
        self.template, self.prefix = t["template"], t["answer_prefix"]
        self.vocab_size = max(8, (seq_len - self.tokens_to_generate) // 50)  # sys_kwext: vocab_size
        self.source = f"coded words: {self.vocab_size} random {CODED_WORDLEN}-letter words, zeta alpha={self.alpha}"
        z = zeta(self.alpha)
        self.weights = [k ** -self.alpha / z for k in range(1, self.vocab_size + 1)]
        # the smallest word count whose top ranks 2-4 (the references) are all strictly more frequent than rank 5
        self.min_size = next(n for n in range(1, 1 << 20) if self._strict_top(n))

    def _counts(self, n: int) -> list[int]:
        return [int(n * w) for w in self.weights]  # sampled_cnt.astype(int)

    def _strict_top(self, n: int) -> bool:
        c = self._counts(n)
        return c[1] > c[2] > c[3] > (c[4] if len(c) > 4 else 0)

    def draw(self, rng: random.Random, index: int) -> dict:
        vocab: set[str] = set()
        while len(vocab) < self.vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=CODED_WORDLEN)))
        words = sorted(vocab)
        rng.shuffle(words)
        words[0] = "..."  # treat the top ranked as noise
        return {"vocab": words, "seed": rng.getrandbits(64)}

    def render(self, d: dict, size: int) -> Rendered:
        sampled = [w for w, c in zip(d["vocab"], self._counts(size)) for _ in range(c)]
        sampled = shuffled(sampled, d["seed"])
        return Rendered(fill(self.template, joined(sampled, " ")), self.prefix, d["vocab"][1:4])
