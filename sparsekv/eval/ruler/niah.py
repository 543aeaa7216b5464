"""Needle in a haystack: the 8 niah_* subtasks (RULER scripts/data/synthetic/niah.py).

Needles "One of the special magic {type_needle_v} for {key} is: {value}." hide in a noise, essay or needle
(distractor) haystack; the question names num_needle_q of the keys and every value of those keys is a reference.
Deviation: RULER inserts needles into noise/needle haystacks at uniformly random lines; we use its 40-point depth
grid for every haystack (as it does for essays), so per-depth results bucket the same way for all subtasks.
"""

from __future__ import annotations

import random
import uuid

from .base import DEPTHS, Generator, Rendered, fill
from .config import CONFIGS, TEMPLATES
from .haystack import NOISE, Essay, lines_context
from .words import random_key

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."


def random_value(rng: random.Random, kind: str) -> str:
    """niah.py generate_random: 7-digit numbers, adjective-noun words, or UUID4s."""
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return random_key(rng)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(kind)


class Niah(Generator):
    def __init__(self, name: str, essay: Essay | None):
        cfg = CONFIGS[name]
        t = TEMPLATES["niah"]
        self.name, self.cfg, self.essay = name, cfg, essay
        self.tokens_to_generate = t["tokens_to_generate"]
        self.haystack = cfg["type_haystack"]
        if self.haystack == "essay" and essay is None:
            self.haystack = "noise"  # no essay text offline: say so in every sample's template string
            self.source = "haystack: noise (no --haystack-file; RULER uses Paul Graham essays)"
        elif self.haystack == "essay":
            self.source = f"haystack: essay ({essay.name})"
        elif self.haystack == "needle":
            self.source = "haystack: needle (distractor needles)"
        else:
            self.source = "haystack: noise"
        self.nk = max(cfg["num_needle_k"], cfg["num_needle_q"])  # niah.py: num_needle_k = max(k, q)
        self.nv, self.nq = cfg["num_needle_v"], cfg["num_needle_q"]
        template, prefix, self.type_v = t["template"], t["answer_prefix"], cfg["type_needle_v"]
        if self.nq * self.nv == 1:  # niah.py: a single answer reads in the singular
            template, prefix = (_singular(x) for x in (template, prefix))
            self.type_v = self.type_v[:-1]
        self.template, self.prefix = template, prefix

    def draw(self, rng: random.Random, index: int) -> dict:
        kind_k, kind_v = self.cfg["type_needle_k"], self.cfg["type_needle_v"]
        keys: list[str] = []
        while len(keys) < self.nk:  # distinct keys, or the question would be ambiguous
            k = random_value(rng, kind_k)
            if k not in keys:
                keys.append(k)
        values = [[random_value(rng, kind_v) for _ in range(self.nv)] for _ in keys]
        needles = [NEEDLE.format(type_needle_v=kind_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)  # niah.py shuffles the needles before placing them at sorted depths
        depths = rng.sample(DEPTHS, len(needles))
        queried = rng.sample(range(self.nk), self.nq)
        queries = [keys[i] for i in queried]
        answers = [v for i in queried for v in values[i]]
        first = NEEDLE.format(type_needle_v=kind_v, key=queries[0], value=answers[0])
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        return {"needles": needles, "depths": depths, "answers": answers, "query": query, "keys": set(keys),
                "depth": depths[needles.index(first)] / 100, "distractors": [],
                "distractor_rng": random.Random(rng.getrandbits(64))}

    def _distractors(self, d: dict, n: int) -> list[str]:
        """The needle haystack: line i is the same distractor whatever the size (drawn once, extended on demand)."""
        out, r = d["distractors"], d["distractor_rng"]
        kind_k, kind_v = self.cfg["type_needle_k"], self.cfg["type_needle_v"]
        while len(out) < n:
            key = random_value(r, kind_k)
            if key in d["keys"]:  # a distractor must not answer the question
                continue
            out.append(NEEDLE.format(type_needle_v=kind_v, key=key, value=random_value(r, kind_v)))
        return out[:n]

    def render(self, d: dict, size: int) -> Rendered:
        if self.haystack == "essay":
            context = self.essay.context(size, d["depths"], d["needles"])
        else:
            units = [NOISE] * size if self.haystack == "noise" else self._distractors(d, size)
            context = lines_context(units, d["depths"], d["needles"])
        pieces = fill(self.template, context, type_needle_v=self.type_v, query=d["query"])
        prefix = self.prefix.format(type_needle_v=self.type_v, query=d["query"])
        return Rendered(pieces, prefix, list(d["answers"]), d["depth"])


def _singular(s: str) -> str:
    # niah.py, when num_needle_q * num_needle_v == 1 (applied to RULER's whole template, answer prefix included)
    return s.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
