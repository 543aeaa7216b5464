"""Haystacks: RULER's noise sentence, and essays read from a user's text file (RULER downloads Paul Graham's essays;
we take any text file, .gz allowed), cut into sentences with a regex instead of NLTK punkt."""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ...errors import SparseKVError
from .base import joined

# RULER niah.py / variable_tracking.py: type_haystack == 'noise'
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# A sentence ends at . ! ? (optionally closed by a quote or bracket) when the next word starts like a sentence.
# Punkt also knows abbreviations; for a haystack the exact cut only moves where a needle may sit, by a sentence.
_END = re.compile(r"[.!?][\"')\]]?$")
_START = re.compile(r"^[\"'(\[]?[A-Z0-9]")
_SPLIT = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentences of `text` (the regex stand-in for nltk.sent_tokenize)."""
    return [s for s in _SPLIT.split(text.strip()) if s]


@dataclass(frozen=True)
class Essay:
    """An essay haystack as RULER holds it: whitespace-separated words, repeated when more are needed
    (niah.py: `re.sub(r'\\s+', " ", essay).split(" ")`, then `(haystack * repeats)[:num_haystack]`)."""

    name: str
    words: tuple[str, ...]
    ends: tuple[int, ...]  # word indices that end a sentence (the next word, cyclically, starts one)
    spaced: tuple[str, ...] = ()  # " " + word, built once: the pieces of the joined text

    def words_at(self, n: int, spaced: bool = False) -> list[str]:
        src = self.spaced if spaced else self.words
        reps = -(-n // len(src))
        return list(src[:n]) if reps <= 1 else list(src * reps)[:n]

    def sentence_starts(self, n: int) -> list[int]:
        """Word index where each sentence of the first n words starts (what sent_tokenize of their join gives)."""
        starts, L = [0], len(self.words)
        for p in range(-(-n // L)):
            for e in self.ends:
                i = p * L + e
                if i >= n - 1:
                    break
                starts.append(i + 1)
        return starts

    def context(self, n: int, depths_pct: list[int], inserts: list[str]) -> list[str]:
        """Pieces of the first n words with `inserts[j]` placed before sentence int(S * depths_pct[j] / 100)
        (niah.py, essay branch: insertion_positions = [0] + sorted(...) + [len(document_sents)], and the
        sentence runs and needles joined by single spaces)."""
        pairs = sorted(zip(depths_pct, inserts), key=lambda x: x[0])
        spaced = self.words_at(n, spaced=True)
        starts = self.sentence_starts(n)
        n_sents = len(starts)
        cut = [0] + [starts[p] if p < n_sents else n for p in (int(n_sents * d / 100) for d, _ in pairs)] + [n]
        pieces: list[str] = []
        for i in range(1, len(cut)):
            run = spaced[cut[i - 1]:cut[i]]
            if run and not pieces:  # the very first word has no space before it
                run[0] = run[0][1:]
            pieces.extend(run if run else [" " if pieces else ""])  # an empty run still leaves its joining space
            if i - 1 < len(pairs):
                pieces.append(" " + pairs[i - 1][1])
        return pieces


def lines_context(units: list[str], depths_pct: list[int], inserts: list[str]) -> list[str]:
    """Noise / needle haystacks, as pieces: one unit per line, `inserts[j]` before unit int(N * depths_pct[j] / 100).
    (niah.py inserts at uniformly random unit indices; we use RULER's depth grid here too, see niah.py header.)"""
    out = list(units)
    n = len(units)
    for d, text in sorted(zip(depths_pct, inserts), key=lambda x: x[0], reverse=True):
        out.insert(int(n * d / 100), text)
    return joined(out, "\n")


@lru_cache(maxsize=8)
def _load(path: str, mtime: float, size: int) -> Essay:
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rt", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise SparseKVError(f"cannot read haystack file {path}: {e}") from None
    words = tuple(re.sub(r"\s+", " ", text).strip().split(" "))
    if words == ("",) or len(words) < 2:
        raise SparseKVError(f"haystack file {path} holds no text")
    L = len(words)
    ends = tuple(i for i in range(L) if _END.search(words[i]) and _START.match(words[(i + 1) % L]))
    return Essay(p.name, words, ends, tuple(" " + w for w in words))


def load_essay(path) -> Essay:
    """Read (and cache) an essay haystack: any text file, gzip-compressed when it ends in .gz."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise SparseKVError(f"haystack file not found: {p}")
    st = p.stat()
    return _load(str(p.resolve()), st.st_mtime, st.st_size)
