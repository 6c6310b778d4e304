"""Input checks that the NumPy, torch and drop-in (``sparsemap.lpsmap``) paths share,
so that one mistake gets one message whichever path meets it.

Imports nothing of its own (torch only inside :func:`check_float_tensor`, which only
the torch paths call), so any module may use it.
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


def check_float_tensor(x, name):
    """``x`` if it is a floating-point ``torch.Tensor``, else ValueError naming ``name``."""
    import torch
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    return x
