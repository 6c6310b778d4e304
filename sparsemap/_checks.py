"""Input checks that the NumPy, torch and drop-in (``sparsemap.lpsmap``) paths share,
so that one mistake gets one message whichever path meets it.

Imports nothing, so any layer may use it. The tensor check lives in
:mod:`sparsemap.torch` (``_check_tensor``), the one module that imports torch; the
drop-in's torch graph calls it there.
"""


def check_per_factor(values, n_factors, name):
    """``values`` as a list with one entry per factor of a graph (``eta_v``, or a
    direction on it): a list or tuple of length ``n_factors``, else ValueError. The
    entries are the caller's to check (arrays, tensors or None)."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name}: expected a list with one entry per factor ({n_factors}), "
                         f"got {type(values).__name__}")
    if len(values) != n_factors:
        raise ValueError(f"{name}: expected a list with one entry per factor ({n_factors}), "
                         f"got length {len(values)}")
    return list(values)

