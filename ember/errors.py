"""Errors ember raises. Every message names what went wrong and where."""

from __future__ import annotations


class EmberError(Exception):
    """An internal failure at a named stage, for a named op when one is known."""

    def __init__(self, stage: str, message: str, op: str | None = None):
        self.stage, self.op = stage, op
        where = f"stage '{stage}'" + (f", op '{op}'" if op else "")
        super().__init__(f"ember failed at {where}: {message}")


class UserInputError(ValueError):
    """The user gave ember something it cannot accept; the message says what to change."""
