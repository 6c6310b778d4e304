"""Warnings and errors shared by every solver (the lowest layer: imports nothing)."""


class ConvergenceWarning(UserWarning):
    """A solver stopped before reaching its tolerance (duality gap or residuals)."""
