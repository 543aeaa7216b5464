"""RULER's synthetic tasks (NVIDIA/RULER scripts/data/synthetic, scripts/synthetic.yaml), generated with the tokenizer
and chat template of the model under test: 8 needle-in-a-haystack variants, variable tracking, common/frequent words
extraction, and SQuAD / HotpotQA QA (through `datasets`; skipped with the reason when unavailable).

    samples, skipped = make_samples(tokenizer, 4096, n=20, subtasks="niah", haystack_file="essays.txt")
"""

from .config import DEFAULT_SUBTASKS, GROUPS, SUBTASKS, check_room, resolve_subtasks, tokens_to_generate
from .generate import make_samples, skipped_subtasks

__all__ = ["SUBTASKS", "DEFAULT_SUBTASKS", "GROUPS", "check_room", "make_samples", "resolve_subtasks",
           "skipped_subtasks", "tokens_to_generate"]
