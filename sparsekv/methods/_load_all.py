"""Imports every method module so each registers itself; add new methods here."""

from . import adamas, dense, lsh, oracle, quest, spotlight, streaming  # noqa: F401
