"""The one exception type the CLI turns into a single clear line and a non-zero exit."""


class SparseKVError(Exception):
    """Bad input or a broken precondition the user can fix: the message is one line that says what and where."""
