"""Warnings and errors shared by every solver (the lowest layer: imports nothing)."""


class ConvergenceWarning(UserWarning):
    """A solver stopped before reaching its tolerance (duality gap or residuals).

    Examples
    --------
    Three conditional-gradient steps are not enough here:

    >>> import warnings, numpy as np, sparsemap as sm
    >>> eta = np.random.default_rng(0).standard_normal((6, 6))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     r = sm.solve(sm.TreeFactor(5), eta, method="cg", max_iter=3)
    >>> r.converged, caught[0].category is sm.ConvergenceWarning
    (False, True)

    To make it an error: ``warnings.simplefilter("error", sm.ConvergenceWarning)``.
    """
