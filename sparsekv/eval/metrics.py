"""Scorers: a prediction and its reference(s) -> a score in [0, 1].

`string_match_all` / `string_match_part` are RULER's (NVIDIA/RULER scripts/eval/synthetic/constants.py): the
prediction is stripped of control characters and both sides are compared lower-cased; "all" is the fraction of
references found, "part" is 1 when any is found. `contains` is the passkey check (the key is in the answer).
"""

from __future__ import annotations

import re

from ..errors import SparseKVError

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's postprocess_pred: strip, control characters replaced by newlines... then stripped again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def contains(prediction: str, references: list[str]) -> float:
    return float(all(r in prediction for r in references))


def string_match_all(prediction: str, references: list[str]) -> float:
    p = postprocess(prediction).lower()
    return sum(1.0 for r in references if r.lower() in p) / len(references) if references else 0.0


def string_match_part(prediction: str, references: list[str]) -> float:
    p = postprocess(prediction).lower()
    return max((1.0 if r.lower() in p else 0.0 for r in references), default=0.0)


SCORERS = {"contains": contains, "string_match_all": string_match_all, "string_match_part": string_match_part}


def score(metric: str, prediction: str, references: list[str]) -> float:
    if metric not in SCORERS:
        raise SparseKVError(f"unknown metric {metric!r}; available: {', '.join(SCORERS)}")
    return SCORERS[metric](prediction, references)
