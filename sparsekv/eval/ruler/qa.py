"""Single- and multi-hop QA (RULER scripts/data/synthetic/qa.py): the gold paragraph(s) of a question among
distractor paragraphs, as "Document i:" blocks; any reference answer counts (string_match_part).

RULER reads SQuAD v2.0 dev (dev-v2.0.json, answerable questions only) and HotpotQA dev distractor
(json/download_qa_dataset.sh); we load the same splits with `datasets` and skip the subtask, with the reason,
when they cannot be had (no network and nothing cached).
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from .base import Generator, Rendered, fill
from .config import CONFIGS, TEMPLATES

DATASETS = {  # RULER dataset name -> (hub id, config, split)
    "squad": ("rajpurkar/squad_v2", None, "validation"),
    "hotpotqa": ("hotpotqa/hotpot_qa", "distractor", "validation"),
}
DOCUMENT = "Document {i}:\n{document}"  # qa.py DOCUMENT_PROMPT


@dataclass
class QAData:
    qas: list[dict]  # {"query", "outputs", "context": [doc ids], "more_context": [doc ids]} in dataset order
    docs: list[str]  # every paragraph once, sorted (qa.py: sorted(list(set(total_docs))))
    source: str


class QAUnavailable(Exception):
    """The dataset cannot be loaded; the message is the reason the subtask is skipped."""


_CACHE: dict[str, QAData | QAUnavailable] = {}


def clear_cache() -> None:
    _CACHE.clear()


def _squad(rows) -> tuple[list[dict], list[str]]:
    """qa.py read_squad, over the `datasets` rows (one per question, in file order): answerable questions only;
    more_context = the other paragraphs of the same article."""
    rows = list(rows)
    docs = sorted({r["context"] for r in rows})
    ids = {c: i for i, c in enumerate(docs)}
    by_title: dict[str, list[int]] = {}
    for r in rows:
        lst = by_title.setdefault(r["title"], [])
        if ids[r["context"]] not in lst:
            lst.append(ids[r["context"]])
    qas = []
    for r in rows:
        if r["answers"]["text"]:  # not is_impossible
            c = ids[r["context"]]
            qas.append({"query": r["question"], "outputs": list(r["answers"]["text"]), "context": [c],
                        "more_context": [i for i in by_title[r["title"]] if i != c]})
    return qas, docs


def _hotpotqa(rows) -> tuple[list[dict], list[str]]:
    """qa.py read_hotpotqa: every paragraph of a question's context (gold + distractors) is its context."""
    rows = list(rows)

    def paras(r):
        return [f"{t}\n{''.join(s)}" for t, s in zip(r["context"]["title"], r["context"]["sentences"])]

    docs = sorted({p for r in rows for p in paras(r)})
    ids = {c: i for i, c in enumerate(docs)}
    qas = [{"query": r["question"], "outputs": [r["answer"]], "context": [ids[p] for p in paras(r)],
            "more_context": []} for r in rows]
    return qas, docs


def _hub_reachable(timeout: float = 3.0) -> str | None:
    """None when the Hub answers a TCP connect, else why not (so an offline machine skips at once, not after
    `datasets`' retries, ~25 s per dataset)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return None  # behind a proxy a direct connect says nothing: let datasets try
    try:
        from huggingface_hub import constants

        url = urlparse(constants.ENDPOINT)
    except Exception:  # noqa: BLE001 - any failure here only means we try load_dataset directly
        return None
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return None
    except OSError as e:
        return f"{url.hostname} unreachable ({e})"


def _cached_locally(hub_id: str) -> bool:
    try:
        from datasets import config

        return any((Path(config.HF_DATASETS_CACHE) / hub_id.replace("/", "___")).glob("*/*/*"))
    except Exception:  # noqa: BLE001
        return False


def load(dataset: str) -> QAData:
    """The QA data of RULER's `dataset` ('squad' or 'hotpotqa'), cached; raises QAUnavailable with the reason."""
    if dataset in _CACHE:
        got = _CACHE[dataset]
        if isinstance(got, QAUnavailable):
            raise got
        return got
    hub_id, config, split = DATASETS[dataset]
    what = f"{hub_id}{'/' + config if config else ''} {split}"
    try:
        try:
            import datasets
        except ImportError as e:
            raise QAUnavailable(f"{what} needs the `datasets` package: pip install 'sparsekv[data]' ({e})") from None
        if not datasets.config.HF_HUB_OFFLINE and not _cached_locally(hub_id):
            why = _hub_reachable()
            if why:
                raise QAUnavailable(f"{what} is not cached and the Hub is not reachable: {why}")
        try:
            ds = datasets.load_dataset(hub_id, config, split=split) if config else \
                datasets.load_dataset(hub_id, split=split)
        except Exception as e:  # noqa: BLE001 - any loading failure skips the subtask with its reason
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise QAUnavailable(f"cannot load {what} with datasets: {type(e).__name__}: {first}") from None
        try:
            qas, docs = (_squad if dataset == "squad" else _hotpotqa)(ds)
        except (KeyError, TypeError) as e:  # the hub copy changed its columns
            raise QAUnavailable(f"{what} has an unexpected format ({type(e).__name__}: {e})") from None
        if not qas:
            raise QAUnavailable(f"{what} holds no usable question")
        _CACHE[dataset] = QAData(qas, docs, what)
    except QAUnavailable as e:
        _CACHE[dataset] = e
        raise
    return _CACHE[dataset]


def unavailable(subtask: str) -> str | None:
    """Why a qa subtask cannot run here, or None when its data loads."""
    try:
        load(CONFIGS[subtask]["dataset"])
        return None
    except QAUnavailable as e:
        return str(e)


class QA(Generator):
    metric = "string_match_part"

    def __init__(self, name: str, budget: int):
        cfg = CONFIGS[name]
        t = TEMPLATES["qa"]
        self.name, self.data = name, load(cfg["dataset"])
        self.tokens_to_generate = t["tokens_to_generate"]
        self.template, self.prefix = t["template"], t["answer_prefix"]
        self.source = f"documents: {self.data.source} via datasets"
        self.cap = max(1, budget // 4)  # a "Document i:" block is never under 4 tokens: no more can fit

    def draw(self, rng: random.Random, index: int) -> dict:
        # qa.py: sample i asks question i; the documents are its gold paragraph(s), then the rest of its article
        # (squad), then random other paragraphs; the chosen ones are shuffled.
        q = self.data.qas[index % len(self.data.qas)]
        more = list(q["more_context"])
        rng.shuffle(more)
        taken = set(q["context"]) | set(more)
        n_docs = len(self.data.docs)
        k = min(self.cap, n_docs - len(taken))
        extra: list[int] = []
        if 2 * k > n_docs:  # most of the pool is wanted: sample the complement directly
            extra = rng.sample([i for i in range(n_docs) if i not in taken], k)
        while len(extra) < k:  # rejection sampling: `taken` is tiny next to the paragraph pool
            i = rng.randrange(n_docs)
            if i not in taken:
                taken.add(i)
                extra.append(i)
        order = list(q["context"]) + more + extra
        return {"q": q, "order": order, "seed": rng.getrandbits(64)}

    def render(self, d: dict, size: int) -> Rendered:
        docs = [self.data.docs[i] for i in d["order"][:size]]
        random.Random(d["seed"]).shuffle(docs)
        context: list[str] = []  # "\n\n".join of "Document i:\n{document}", header and paragraph as two pieces
        for i, doc in enumerate(docs):
            head = DOCUMENT.split("{document}")[0].format(i=i + 1)
            context += [("\n\n" if i else "") + head, doc]
        return Rendered(fill(self.template, context, query=d["q"]["query"]), self.prefix, list(d["q"]["outputs"]))

    def bounds(self, d: dict) -> tuple[int, int]:
        return len(d["q"]["context"]), len(d["order"])  # hotpotqa's 10 paragraphs always go in
