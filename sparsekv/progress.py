"""Progress for long library work without tying the library to the CLI: a rich Progress, a callback, or None."""

from __future__ import annotations

from typing import Any


class Ticker:
    """Advances a rich `Progress` task named `label`, or calls `progress(done, total)`, or does nothing."""

    def __init__(self, progress: Any, total: int, label: str):
        self.progress, self.total, self.done = progress, total, 0
        self.task = progress.add_task(label, total=total) if hasattr(progress, "add_task") else None

    def advance(self, n: int) -> None:
        self.done += n
        if self.task is not None:
            self.progress.advance(self.task, n)
        elif callable(self.progress):
            self.progress(self.done, self.total)
