"""Common words extraction (RULER scripts/data/synthetic/common_words_extraction.py): a numbered list where 10 words
appear freq_cw times and the rest freq_ucw times; the references are the 10 common words. One solved example first.

Word pool: RULER samples wonderwords' nouns+adjectives+verbs, and a large English word list once it needs more words
than those; ours are the embedded lists (words.py), widened with adjective+noun compounds when they run out.
"""

from __future__ import annotations

import random

from .base import Generator, Rendered, fill, shuffled
from .config import CONFIGS, TEMPLATES
from .words import common_words, extended_words


def _numbered(words: list[str]) -> list[str]:
    """Pieces of "1. w1 2. w2 ...": numbers and words apart, so their token counts are reused across sizes."""
    out: list[str] = []
    for i, w in enumerate(words):
        out += [f" {i + 1}." if i else "1.", " " + w]
    return out


class CommonWords(Generator):
    def __init__(self, name: str, seq_len: int, budget: int):
        cfg = CONFIGS[name]
        t = TEMPLATES["common_words_extraction"]
        self.name, self.num_cw = name, cfg["num_cw"]
        self.tokens_to_generate = t["tokens_to_generate"]
        self.template, self.prefix = t["template"], t["answer_prefix"]
        # one solved example (--num_fewshot 1): (words, repeats of its common words, repeats of the others)
        if seq_len < 4096:  # generate_input_output: short contexts use lighter repeats and a smaller example
            self.example = (20, 3, 1)
            self.freq, self.ufreq = 6, 1
        else:
            self.example = (40, 10, 3)
            self.freq, self.ufreq = cfg["freq_cw"], cfg["freq_ucw"]
        # no list can need more distinct words than entries fit in the budget (each entry is >= 1 token)
        self.cap = budget // self.ufreq + self.num_cw
        self.min_size = self.num_cw + 1
        self._use(common_words(), "embedded word list")

    def _use(self, pool: tuple[str, ...], what: str) -> None:
        self.pool = pool
        self.max_size = min(len(pool), self.cap)
        self.source = f"words: {what} ({len(pool)} words), {self.num_cw} words x{self.freq} vs x{self.ufreq}"

    def grow(self) -> bool:
        if self.pool is extended_words() or self.max_size >= self.cap:
            return False
        self._use(extended_words(), "embedded word list + adjective-noun compounds")
        return True

    def draw(self, rng: random.Random, index: int) -> dict:
        n_ex, freq_ex, ufreq_ex = self.example
        ctx_ex, ans_ex = self._list(rng.sample(common_words(), n_ex), freq_ex, ufreq_ex, rng.getrandbits(64))
        # generate_input_output: the solved example is the task text + answer prefix + " " + its numbered answer
        example = "".join(fill(self.template, ctx_ex)) + self.prefix + " " + "".join(_numbered(ans_ex))
        return {"example": example, "order": rng.sample(self.pool, self.max_size), "seed": rng.getrandbits(64)}

    def _list(self, words: list[str], freq: int, ufreq: int, seed: int) -> tuple[list[str], list[str]]:
        """get_example: the first num_cw words are the common ones; the repeated list is shuffled."""
        common, uncommon = words[:self.num_cw], words[self.num_cw:]
        listed = shuffled(common * freq + uncommon * ufreq, seed)
        return _numbered(listed), common

    def render(self, d: dict, size: int) -> Rendered:
        context, answers = self._list(d["order"][:size], self.freq, self.ufreq, d["seed"])
        return Rendered([d["example"] + "\n", *fill(self.template, context)], self.prefix, answers)
