"""CPU timers shared by the benchmark scripts (medians or minima over repeated runs;
never wall time, since the machines these run on are shared)."""
import time

import numpy as np


def best_time(fn, repeats, budget=np.inf, clock=time.process_time):
    """The fastest of up to ``repeats`` calls of fn in CPU seconds of ``clock`` (fewer
    calls once ``budget`` seconds are spent), and the last call's result."""
    best, spent, out = np.inf, 0.0, None
    for _ in range(repeats):
        t0 = clock()
        out = fn()
        t = clock() - t0
        best, spent = min(best, t), spent + t
        if spent > budget:
            break
    return best, out


def cpu_median(fn, repeats):
    """Median CPU seconds (``time.process_time``) of ``repeats`` calls of fn, and the
    last call's result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        times.append(time.process_time() - t0)
    return float(np.median(times)), out
