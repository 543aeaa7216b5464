"""RULER's 13 tasks as data: the task templates, answer prefixes and tokens_to_generate of
scripts/data/synthetic/constants.py, and the per-task arguments of scripts/synthetic.yaml. Also the subtask names
and groups the CLI accepts."""

from __future__ import annotations

from ...errors import SparseKVError

# scripts/data/synthetic/constants.py (TASKS): template, answer_prefix, tokens_to_generate
TEMPLATES = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                    "magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                         "variables are assigned the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. "
                    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
                    "words in the above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most "
                    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                    "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
                    "text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output "
                    "any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question "
                    "based on the given documents. Only give me the answer and do not output any other words.\n\n"
                    "Question: {query}",
        "answer_prefix": " Answer:",
    },
}


def _niah(haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> dict:
    return {"task": "niah", "type_haystack": haystack, "type_needle_k": k, "type_needle_v": v,
            "num_needle_k": nk, "num_needle_v": nv, "num_needle_q": nq}


# scripts/synthetic.yaml, in its order
CONFIGS: dict[str, dict] = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", nk=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", nv=4),
    "niah_multiquery": _niah("essay", "words", "numbers", nq=4),
    "vt": {"task": "variable_tracking", "type_haystack": "noise", "num_chains": 1, "num_hops": 4},
    "cwe": {"task": "common_words_extraction", "freq_cw": 30, "freq_ucw": 3, "num_cw": 10},
    "fwe": {"task": "freq_words_extraction", "alpha": 2.0},
    "qa_1": {"task": "qa", "dataset": "squad"},
    "qa_2": {"task": "qa", "dataset": "hotpotqa"},
}

SUBTASKS: tuple[str, ...] = tuple(CONFIGS)
# The default run is RULER's full suite; qa_1/qa_2 are skipped, with the reason, when their data cannot be loaded.
DEFAULT_SUBTASKS: tuple[str, ...] = SUBTASKS

GROUPS: dict[str, tuple[str, ...]] = {
    "all": SUBTASKS,
    "niah": tuple(s for s in SUBTASKS if s.startswith("niah_")),
    "niah_single": tuple(s for s in SUBTASKS if s.startswith("niah_single_")),
    "niah_multikey": tuple(s for s in SUBTASKS if s.startswith("niah_multikey_")),
    "aggregation": ("cwe", "fwe"),
    "qa": ("qa_1", "qa_2"),
    "synthetic": tuple(s for s in SUBTASKS if not s.startswith("qa_")),  # no external data needed
}
# RULER's script names for the single-config tasks
ALIASES = {"variable_tracking": "vt", "common_words_extraction": "cwe", "freq_words_extraction": "fwe"}


def tokens_to_generate(subtask: str) -> int:
    return TEMPLATES[CONFIGS[subtask]["task"]]["tokens_to_generate"]


def check_room(seq_len: int, subtasks: list[str]) -> None:
    """A length that cannot hold a subtask's generated tokens fails here, before any model or tokenizer loads (the
    prompts' own lengths need the tokenizer: `make_samples` checks those)."""
    for name in subtasks:
        if seq_len <= tokens_to_generate(name):
            raise SparseKVError(f"seq {seq_len} is too short for RULER subtask {name}: it generates "
                                f"{tokens_to_generate(name)} tokens alone")


def resolve_subtasks(spec: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Subtask names, group names (all, niah, niah_single, niah_multikey, aggregation, qa, synthetic) or a
    comma-separated string of them -> subtask names in RULER's order, each once."""
    if spec is None:
        return list(SUBTASKS)
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    wanted: set[str] = set()
    for item in (x.strip() for x in items):
        if not item:
            continue
        item = ALIASES.get(item, item)
        if item in GROUPS:
            wanted.update(GROUPS[item])
        elif item in CONFIGS:
            wanted.add(item)
        else:
            raise SparseKVError(f"unknown RULER subtask {item!r}; available: {', '.join(SUBTASKS)}; "
                                f"groups: {', '.join(GROUPS)}")
    if not wanted:
        raise SparseKVError(f"no RULER subtask named; available: {', '.join(SUBTASKS)}; groups: {', '.join(GROUPS)}")
    return [s for s in SUBTASKS if s in wanted]
