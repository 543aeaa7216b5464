"""Imports every method module so each registers itself; add new methods here."""

from . import adamas, dense, lsh, oracle, quest, spotlight, streaming  # noqa: F401
from . import saap  # noqa: F401
