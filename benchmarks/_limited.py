"""Run timing jobs in a child process that is killed past a time limit.

A SparseMAP solve cannot be interrupted from Python (the solver runs without the GIL
in compiled code), and on some scores it runs for a minute or more. The layer
benchmarks time each call in a forked worker: the parent waits at most ``limit``
seconds of wall time for the answer, then kills that worker (by its own handle) and
starts a new one, and the call is reported as over the limit. The work is done and
timed (CPU time) inside the worker, so the limit never enters a measurement.
"""
import multiprocessing as mp
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


class LimitedWorker:
    """``run(fn, *args)`` -> ``fn(*args)`` from a forked worker, or ``None`` when it
    took more than ``limit`` seconds (wall time; the worker is then replaced)."""

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
        self._conn.send((fn, args))
        if not self._conn.poll(self.limit):
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
