"""The driver: for each subtask, n samples whose prompt (chat template + task text + answer prefix) plus RULER's
tokens_to_generate fills seq_len as closely as the haystack unit allows, with the tokenizer under test."""

from __future__ import annotations

import math
import random

from ...errors import SparseKVError
from ..prompts import build_prompt
from ..sample import Sample
from . import qa
from .base import Generator, Rendered
from .config import CONFIGS, check_room, resolve_subtasks, tokens_to_generate
from .cwe import CommonWords
from .fit import largest_fitting
from .fwe import FreqWords
from .haystack import Essay, load_essay
from .niah import Niah
from .vt import VariableTracking


def _generator(name: str, seq_len: int, budget: int, essay: Essay | None) -> Generator:
    task = CONFIGS[name]["task"]
    if task == "niah":
        return Niah(name, essay)
    if task == "variable_tracking":
        return VariableTracking(name)
    if task == "common_words_extraction":
        return CommonWords(name, seq_len, budget)
    if task == "freq_words_extraction":
        return FreqWords(name, seq_len)
    return qa.QA(name, budget)


def skipped_subtasks(subtasks=None) -> dict[str, str]:
    """{subtask: reason} for the asked subtasks that cannot run here (qa_* without their datasets). Never raises
    for a missing dataset; loads and caches the data when it is there."""
    return {name: why for name in resolve_subtasks(subtasks)
            if CONFIGS[name]["task"] == "qa" and (why := qa.unavailable(name))}


class TooShort(SparseKVError):
    """A length below a subtask's shortest prompt plus its generation; `needs`: the shortest length that fits."""

    def __init__(self, name: str, seq_len: int, prompt: int, gen: int):
        self.subtask, self.needs = name, prompt + gen
        super().__init__(f"seq {seq_len} is too short for RULER subtask {name}: its shortest prompt is {prompt} "
                         f"tokens and {gen} are generated (needs seq >= {prompt + gen})")


def _rng(name: str, seed: int, index: int) -> random.Random:
    # one stream per (subtask, seed, sample): a sample does not change with n or with the other subtasks asked for
    return random.Random(f"sparsekv-ruler:{name}:{seed}:{index}")


class _PieceCounter:
    """Token counts of text pieces, each tokenized once (in batches): the sum over a render's pieces predicts its
    prompt length without tokenizing the whole haystack again at every search step."""

    def __init__(self, tokenizer):
        self.cache = {"": 0}
        backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers: skip the per-encoding wrapper
        if backend is not None:
            self.encode = lambda texts: [len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]
        else:
            self.encode = lambda texts: [len(x) for x in tokenizer(texts, add_special_tokens=False).input_ids]

    def __call__(self, pieces: list[str]) -> int:
        cache = self.cache
        try:
            return sum(map(cache.__getitem__, pieces))
        except KeyError:
            new = list({p for p in pieces if p not in cache})
            cache.update(zip(new, self.encode(new)))
            return sum(map(cache.__getitem__, pieces))


class _Fitter:
    """Per subtask: picks each sample's haystack size. The prompt length is predicted as
    alpha * (sum of piece counts) + delta, anchored on the exact length (build_prompt) after every exact encode;
    a sample usually costs one exact encode. alpha is measured on the first sample (1.0 for byte-level BPE, where
    pieces split at pre-token boundaries; less for tokenizers that add a prefix space to every piece)."""

    def __init__(self, gen: Generator, tokenizer, seq_len: int, budget: int):
        self.gen, self.tokenizer, self.seq_len, self.budget = gen, tokenizer, seq_len, budget
        self.pieces = _PieceCounter(tokenizer)
        self.alpha, self.delta, self.start, self.slope = 1.0, 0.0, None, 1.0
        self.calibrated = False

    def fit(self, d) -> tuple[int, list[int], str, Rendered]:
        """-> (size, prompt ids, template description, rendered) for the largest size that fits the budget."""
        gen, budget = self.gen, self.budget
        lo, hi = gen.bounds(d)
        approx_memo: dict[int, int] = {}
        exact: dict[int, tuple] = {}

        def approx(size: int) -> int:
            if size not in approx_memo:
                r = gen.render(d, size)
                approx_memo[size] = self.pieces(r.pieces) + self.pieces([r.answer_prefix])
            return approx_memo[size]

        def full(size: int) -> int:
            if size not in exact:
                r = gen.render(d, size)
                ids, template = build_prompt(self.tokenizer, r.text, r.answer_prefix)
                exact[size] = (ids, template, r)
            return len(exact[size][0])

        if self.start is None:  # first sample: anchor on the smallest prompt, which must fit
            if full(lo) > budget:
                raise TooShort(gen.name, self.seq_len, full(lo), gen.tokens_to_generate)
            self.delta, self.start = full(lo) - approx(lo), lo
            probe = lo + 16 if hi is None else min(hi, lo + 16)  # tokens per unit, so the first jump lands near
            if probe > lo:
                self.slope = max((approx(probe) - approx(lo)) / (probe - lo), 1e-3)
        ok = bad = None
        delta, start = self.delta, self.start
        for _ in range(8):
            low, high = (ok + 1 if ok is not None else lo), (bad - 1 if bad is not None else hi)
            if high is not None and low > high:
                break
            s, self.slope = largest_fitting(lambda x: math.ceil(self.alpha * approx(x) + delta - 1e-9), budget,
                                            start, low, high, self.slope)
            s = low if s is None else s
            t = full(s)
            if not self.calibrated and s != lo and approx(s) != approx(lo):  # tokens per counted piece-token
                self.alpha, self.calibrated = max(0.05, (t - full(lo)) / (approx(s) - approx(lo))), True
            delta = t - self.alpha * approx(s)  # re-anchor the prediction on this exact length
            if t <= budget:
                ok = s
                if s == high or self.alpha * approx(s + 1) + delta > budget:
                    break
            else:
                bad = s
                if ok is not None and bad == ok + 1:
                    break
            start = s
        if ok is None:  # the prediction kept missing: search on exact lengths
            ok, _ = largest_fitting(full, budget, start, lo, hi, self.slope)
            if ok is None:
                raise TooShort(gen.name, self.seq_len, full(lo), gen.tokens_to_generate)
        self.delta, self.start = delta, ok
        full(ok)
        ids, template, r = exact[ok]
        return ok, ids, template, r


def _subtask_samples(gen: Generator, tokenizer, seq_len: int, budget: int, n: int, seed: int) -> list[Sample]:
    gen.prepare(tokenizer)
    fitter = _Fitter(gen, tokenizer, seq_len, budget)
    out: list[Sample] = []
    for i in range(n):
        d = gen.draw(_rng(gen.name, seed, i), i)
        size, ids, template, r = fitter.fit(d)
        # the source ran out before the budget did (cwe's word pool): widen it, once, on the first sample
        if i == 0 and size == gen.bounds(d)[1] and gen.grow():
            fitter = _Fitter(gen, tokenizer, seq_len, budget)
            d = gen.draw(_rng(gen.name, seed, i), i)
            size, ids, template, r = fitter.fit(d)
        out.append(Sample(ids=ids, answer=r.answers, depth=r.depth, template=f"{template}; {gen.source}",
                          max_new_tokens=gen.tokens_to_generate, subtask=gen.name, metric=gen.metric))
    return out


def make_samples(tokenizer, seq_len: int, n: int, seed: int = 42, subtasks=None,
                 haystack_file=None) -> tuple[list[Sample], dict[str, str]]:
    """n samples per subtask (RULER's order), deterministic in seed; -> (samples, {skipped subtask: reason})."""
    names = resolve_subtasks(subtasks)
    if n < 0:
        raise SparseKVError(f"n must be >= 0, got {n}")
    essay = load_essay(haystack_file) if haystack_file is not None else None
    samples: list[Sample] = []
    skipped: dict[str, str] = {}
    short: list[TooShort] = []
    check_room(seq_len, names)
    for name in names:
        budget = seq_len - tokens_to_generate(name)
        try:
            gen = _generator(name, seq_len, budget, essay)
        except qa.QAUnavailable as e:
            skipped[name] = str(e)
            continue
        try:
            samples.extend(_subtask_samples(gen, tokenizer, seq_len, budget, n, seed))
        except TooShort as e:  # the other subtasks are measured too: one error names every length needed
            short.append(e)
    if len(short) == 1:
        raise short[0]
    if short:
        raise SparseKVError(f"seq {seq_len} is too short for RULER subtasks "
                            + ", ".join(f"{e.subtask} (needs seq >= {e.needs})" for e in short)
                            + f": use --seq {max(e.needs for e in short)} or more, or leave them out (--subtasks)")
    return samples, skipped
