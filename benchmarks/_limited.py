"""Run timing jobs in a child process that is killed past a time limit.

A SparseMAP solve cannot be interrupted from Python (the solver runs without the GIL
in compiled code), and on some scores it runs for a minute or more. The layer
benchmarks time each call in a forked worker: once the worker has spent ``limit``
seconds of CPU time on a call (read from ``/proc``, so that a busy machine, which
slows the worker's wall clock, does not cut calls early), the parent kills that
worker (by its own handle) and starts a new one, and the call is reported as over
the limit. The work is done and timed (CPU time) inside the worker, so the limit
never enters a measurement.
"""
import multiprocessing as mp
import os
import time
import traceback


def _serve(conn):
    while True:
        job = conn.recv()
        if job is None:
            return
        fn, args = job
        try:
            conn.send(("ok", fn(*args)))
        except Exception:                          # report it; the parent raises it
            conn.send(("error", traceback.format_exc()))


def _cpu_seconds(pid):
    """CPU seconds (user + system) a process has used, from /proc (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class LimitedWorker:
    """``run(fn, *args)`` -> ``fn(*args)`` from a forked worker, or ``None`` when it
    spent more than ``limit`` CPU seconds on the call (without /proc: ``limit``
    seconds of wall time; also after ``wall_factor * limit`` seconds of wall time
    whatever the CPU says). The worker is then replaced."""

    wall_factor = 20

    def __init__(self, limit):
        self.limit = limit
        self._ctx = mp.get_context("fork")
        self._proc = None

    def _start(self):
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child,), daemon=True)
        self._proc.start()
        child.close()

    def run(self, fn, *args):
        if self._proc is None or not self._proc.is_alive():
            self._start()
        pid = self._proc.pid
        cpu0, wall0 = _cpu_seconds(pid), time.monotonic()
        self._conn.send((fn, args))
        while not self._conn.poll(0.1):
            cpu, wall = _cpu_seconds(pid), time.monotonic() - wall0
            spent = wall if cpu is None or cpu0 is None else cpu - cpu0
            if spent > self.limit or wall > self.wall_factor * self.limit:
                self._proc.kill()
                self._proc.join()
                self._proc = None
                return None
        status, out = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"in the timing worker:\n{out}")
        return out

    def close(self):
        if self._proc is not None and self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
        self._proc = None
