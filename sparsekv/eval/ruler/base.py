"""What every RULER subtask generator provides, so one driver (generate.py) fits and tokenizes them all.

A generator splits a sample into `draw` (all its random choices: keys, values, depths, word order...) and `render`
(the text for a given haystack size). Draws never depend on the size, so the size search changes only how much
haystack there is, never the needle or the answer (RULER re-draws on every search step; the distribution is the same).
`render` returns the user text as pieces (words, lines, list entries) so the search can count tokens per piece.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

# scripts/data/synthetic/niah.py: DEPTHS = np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)
DEPTHS: tuple[int, ...] = tuple(round(100 * i / 39) for i in range(40))


@dataclass
class Rendered:
    pieces: list[str]  # the user turn (RULER's task template, filled) = "".join(pieces)
    answer_prefix: str  # RULER's answer prefix, put after the generation prompt (build_prompt)
    answers: list[str]  # the references ("outputs")
    depth: float | None = None  # needle depth in [0, 1] (niah only)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def fill(template: str, context: list[str], **fields) -> list[str]:
    """A task template with its {context} given as pieces; the other fields are formatted into the fixed parts."""
    head, tail = template.split("{context}")
    return [head.format(**fields), *context, tail.format(**fields)]


def joined(items: list[str], sep: str) -> list[str]:
    """Pieces of sep.join(items): each item after the first carries the separator in front (" word", "\\nline")."""
    return [items[0], *(sep + x for x in items[1:])] if items else []


def shuffled(items: list, seed: int) -> list:
    """items in a random order fixed by seed (RULER shuffles with random.Random(seed); numpy is faster at the
    thousands of list entries cwe/fwe re-shuffle at every search step)."""
    order = np.random.default_rng(seed).permutation(len(items))
    return [items[i] for i in order]


class Generator:
    """One subtask. Sizes count haystack units: words (essay, cwe), lines (noise, needle), documents (qa)..."""

    name: str
    tokens_to_generate: int
    metric: str = "string_match_all"
    source: str = ""  # what the haystack / data is, stated in each sample's template string
    min_size: int = 1
    max_size: int | None = None

    def prepare(self, tokenizer) -> None:
        """Once per subtask, before any draw (e.g. vt sizes its in-context example with the tokenizer)."""

    def draw(self, rng: random.Random, index: int) -> Any:
        raise NotImplementedError

    def render(self, draw: Any, size: int) -> Rendered:
        raise NotImplementedError

    def bounds(self, draw: Any) -> tuple[int, int | None]:
        """Smallest and largest haystack size for this draw."""
        return self.min_size, self.max_size

    def grow(self) -> bool:
        """Called when the largest size that fits is max_size: widen the source (cwe's word pool) if possible."""
        return False
