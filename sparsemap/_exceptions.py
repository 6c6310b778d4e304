"""Warnings and errors shared by every solver (the lowest layer: imports nothing of its own)."""
import sys
import warnings


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


class ConvergenceError(RuntimeError):
    """A factor graph's solve stopped without a certified solution.

    :meth:`sparsemap.FactorGraph.solve` returns the optimum of its problem,
    certified, or raises: its iterates are not points of the constraints, so an
    uncertified one is never returned. This error is raised when ``max_iter``
    ADMM iterations ran out first; an infeasible graph raises ``ValueError``
    instead. Raising ``max_iter`` is the remedy.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> fg = sm.FactorGraph()
    >>> x = fg.add_variables((3, 4))
    >>> for i in range(3):
    ...     _ = fg.add(sm.XorFactor(4), x[i])
    >>> for j in range(4):
    ...     _ = fg.add(sm.AtMostOneFactor(3), x[:, j])
    >>> scores = np.random.default_rng(0).standard_normal((3, 4))
    >>> try:
    ...     fg.solve({x: scores}, max_iter=2)
    ... except sm.ConvergenceError as exc:
    ...     print(str(exc)[:59])
    FactorGraph.solve: no certified solution after 2 ADMM itera
    >>> fg.solve({x: scores}).converged
    True
    """


# Frames of these packages lie between what a warning is about and the user's line:
# sparsemap's own, torch's (autograd's Function.apply, the engine running a backward
# pass), whose number changes between torch versions (2.14 has one fewer than 2.13), and
# the thread machinery under a worker thread's first frame.
_INTERNAL = ("sparsemap", "torch", "threading", "concurrent.futures")


def _internal(frame):
    name = frame.f_globals.get("__name__") or ""
    return any(name == p or name.startswith(p + ".") for p in _INTERNAL)


def warn(message, category=ConvergenceWarning):
    """``warnings.warn`` pointed at the user's line: the first frame outside sparsemap and torch.

    The frame is found by walking the stack, not by counting frames, so it is right under
    any torch version and from any depth of sparsemap (compiled Cython functions have no
    frame: they are transparent). Where the stack has no such frame (a worker thread of
    sparsemap's own pool, a backward pass run by torch's engine in its own thread), the
    warning points at sparsemap's line that issued it.
    """
    frame = sys._getframe(1)
    level = 2                     # stacklevel 2: the caller of this function
    while frame is not None and _internal(frame):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
