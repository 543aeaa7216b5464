"""One prompt of a generation task, as every task generator returns it and the runner consumes it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sample:
    ids: list[int]  # prompt token ids (context + question + answer prefix, chat template applied)
    answer: str | list[str]  # reference string(s) the prediction is scored against
    depth: float | None  # where the needle sits (0 = start of the context, 1 = end); None when the task has none
    template: str  # how the prompt was assembled (stated in every result)
    max_new_tokens: int = 10  # generation length (RULER's tokens_to_generate for its tasks)
    subtask: str | None = None  # e.g. "niah_single_1" for RULER; results are broken down by it
    metric: str = "contains"  # scorer name in eval.metrics: contains, string_match_all, string_match_part

    @property
    def references(self) -> list[str]:
        return [self.answer] if isinstance(self.answer, str) else list(self.answer)
