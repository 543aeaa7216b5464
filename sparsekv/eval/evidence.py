"""Where a prompt spells its answer: the evidence tokens of a passkey or RULER prompt.

A needle-in-a-haystack answer is copied from a few tokens of the prompt (the pass key, the needle's value). Whether
a sparse method reads those tokens at answer time decides its score far more than the attention mass it keeps, of
which the needle is a small part. `dump --task` records these positions and `eval --task recall` reports the share
of the attention on them that each selection reads.
"""

from __future__ import annotations

import bisect
import itertools
import re
from typing import Any, Sequence


def evidence_positions(tokenizer: Any, ids: Sequence[int], references: Sequence[str]) -> list[int]:
    """Sorted positions of the tokens of `ids` that spell any reference, at every place it occurs as a whole word
    (not inside a longer word or number). Tokens are decoded one by one and laid end to end, so a token that holds
    a reference's first or last characters together with its neighbours' counts as evidence."""
    pieces = tokenizer.batch_decode([[int(t)] for t in ids])
    ends = list(itertools.accumulate(len(p) for p in pieces))  # ends[i]: the character after token i
    text = "".join(pieces)
    found: set[int] = set()
    for ref in references:
        ref = ref.strip()
        if not ref:
            continue
        for m in re.finditer(rf"(?<!\w){re.escape(ref)}(?!\w)", text):
            first = bisect.bisect_right(ends, m.start())  # the token holding the first character
            last = bisect.bisect_left(ends, m.end())  # the token holding the last one
            found.update(range(first, last + 1))
    return sorted(found)
