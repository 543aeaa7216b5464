"""Variable tracking (RULER scripts/data/synthetic/variable_tracking.py): a chain "VAR ABCDE = 12345",
"VAR FGHIJ = VAR ABCDE ", ... hidden in noise lines; the references are every variable holding the value.

As in RULER, one solved example (3-letter variables, a <= 500-token prompt) precedes the question; RULER builds it
once and re-letters it per sample (randomize_icl), we draw a fresh one per sample: the same thing.
"""

from __future__ import annotations

import random
import string

from .base import Generator, Rendered, fill, joined
from .config import CONFIGS, TEMPLATES
from .fit import largest_fitting
from .haystack import NOISE

ICL_MAX_TOKENS = 500  # variable_tracking.py main(): the example is generated with max_seq_length=500
_RES = 1 << 30  # insertion points are drawn as fractions of the haystack, so they do not depend on its size


def _chain(rng: random.Random, hops: int, letters: int, value: int) -> tuple[list[str], list[str]]:
    """generate_chains: hops+1 distinct variable names, the first assigned the value, each next one the previous."""
    names: list[str] = []
    while len(names) < hops + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if v not in names:
            names.append(v)
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    return names, lines


def _noise_with_chain(lines: list[str], fractions: list[int], size: int) -> list[str]:
    """Noise branch: the chain's lines go, in order, at sorted random lines of the noise (positions[j] + j).
    (RULER's context.replace(". \\n", ".\\n") changes nothing here: no noise or chain line ends in ". ".)"""
    sentences = [NOISE] * size
    for j, f in enumerate(sorted(fractions)):
        sentences.insert(f * size // _RES + j, lines[j])
    return joined(sentences, "\n")


class VariableTracking(Generator):
    def __init__(self, name: str = "vt"):
        cfg = CONFIGS[name]
        t = TEMPLATES["variable_tracking"]
        self.name, self.hops = name, cfg["num_hops"]
        assert cfg["num_chains"] == 1 and cfg["type_haystack"] == "noise"  # what synthetic.yaml runs
        self.tokens_to_generate = t["tokens_to_generate"]
        self.template, self.prefix = t["template"], t["answer_prefix"]
        self.source = f"haystack: noise; {cfg['num_chains']} chain of {self.hops} hops; 1 solved example"
        self.icl_size = 5

    def prepare(self, tokenizer) -> None:
        """Size the solved example: the most noise lines keeping it within 500 tokens (no template, no generation)."""
        d = self._draw_chain(random.Random("sparsekv-ruler:vt:icl-size"), letters=3)

        def count(size: int) -> int:
            return len(tokenizer(self._example(d, size), add_special_tokens=False).input_ids)

        size, _ = largest_fitting(count, ICL_MAX_TOKENS, 20, 1, slope=20.0)
        self.icl_size = size or 1

    def _draw_chain(self, rng: random.Random, letters: int) -> dict:
        value = rng.randrange(10000, 99999)  # np.random.randint(10000, 99999)
        names, lines = _chain(rng, self.hops, letters, value)
        return {"value": value, "names": names, "lines": lines,
                "fractions": rng.sample(range(_RES), len(lines))}

    def _question(self, d: dict, size: int) -> tuple[list[str], str]:
        context = _noise_with_chain(d["lines"], d["fractions"], size)
        q = fill(self.template, context, query=d["value"], num_v=self.hops + 1)
        return q, self.prefix.format(query=d["value"], num_v=self.hops + 1)

    def _example(self, d: dict, size: int) -> str:
        # sys_vartrack_w_noise_random: example input (answer prefix included) + " " + its answer + "\n"
        q, prefix = self._question(d, size)
        return "".join(q) + prefix + " " + " ".join(d["names"]) + "\n"

    def draw(self, rng: random.Random, index: int) -> dict:
        icl = self._draw_chain(rng, letters=3)
        return {"example": self._example(icl, self.icl_size), "main": self._draw_chain(rng, letters=5)}

    def render(self, d: dict, size: int) -> Rendered:
        q, prefix = self._question(d["main"], size)
        # the example goes between the model template and the task text, followed by a newline
        return Rendered([d["example"] + "\n", *q], prefix, list(d["main"]["names"]))
