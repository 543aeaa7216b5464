"""Imports every method module so each registers itself; add new methods here."""

from . import adamas, dense, oracle, streaming  # noqa: F401
