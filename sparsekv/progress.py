"""Progress for long library work without tying the library to the CLI: a rich Progress, a callback, or None."""

from __future__ import annotations

from typing import Any


class Ticker:
    """Advances a rich `Progress` task named `label`, or calls `progress(done, total)`, or does nothing."""

    def __init__(self, progress: Any, total: int | None, label: str):
        self.progress, self.total, self.done = progress, total, 0
        self.task = progress.add_task(label, total=total) if hasattr(progress, "add_task") else None

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.task is not None:
            self.progress.advance(self.task, n)
        elif callable(self.progress):
            self.progress(self.done, self.total)

    def update(self, label: str | None = None, total: int | None = None) -> None:
        """A new label, or a new total (work found as it goes: a grid learns each length's prompt count)."""
        if total is not None:
            self.total = total
        if self.task is not None:
            self.progress.update(self.task, **({} if label is None else {"description": label}),
                                 **({} if total is None else {"total": total}))

    def note(self, text: str) -> None:
        """A line for the reader beside the bar (a rich Progress only)."""
        if self.task is not None:
            self.progress.console.print(text, style="yellow", markup=False, highlight=False)
