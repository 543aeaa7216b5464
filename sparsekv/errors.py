"""The one exception type the CLI turns into a single clear line and a non-zero exit."""


class SparseKVError(Exception):
    """Bad input or a broken precondition the user can fix: the message is one line that says what and where."""


def one_line(e: BaseException, limit: int | None = None) -> str:
    """Another library's exception as one line of ours: its message with whitespace runs collapsed (its type's name
    when it has none), cut at `limit` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."
