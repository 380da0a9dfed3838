"""The planners' errors: what the arguments or the memory limit make impossible, said so a user can fix it."""

from __future__ import annotations


class PlanMemoryError(MemoryError):
    """No usable mesh fits the memory limit."""


class PlanInputError(ValueError):
    """The arguments do not describe a plannable program."""
