"""The errors :func:`~muonlab.launcher.launch` raises, and the one a worker raises for a
BaseException elastic would not record. Their own module: the worker raises one and the caller the
others, and neither side should import the other for them."""

from __future__ import annotations

__all__ = ["WorkerBaseException", "WorkerError", "WorkerTimeout"]


class WorkerError(RuntimeError):
    """One or more worker processes of :func:`launch` failed.

    ``failures`` maps each failed rank to its error text (the worker's traceback where Python
    recorded one); ``ranks`` lists those ranks, the first observed failure first; ``run_dir`` is
    the launch's run directory (each rank's logs in ``rank<r>/``), None if there was none.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None, run_dir: str | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.ranks = list(self.failures)
        self.run_dir = run_dir


class WorkerTimeout(WorkerError):
    """:func:`launch` ran out of time; ``ranks`` are the ranks that hung: still running their
    function then and not inside a collective (a rank that had returned and was waiting for the
    others is not among them). ``waiting`` are the ranks that were running but inside a
    collective, waiting for those; where every running rank was inside one (ranks in different
    collectives), ``ranks`` names them all and ``waiting`` is empty.

    ``phase`` says which limit expired: ``"startup"`` (``startup_timeout_s``: not every rank had
    initialised its process group) or ``"run"`` (``timeout_s``, counted from when every rank had).
    """

    def __init__(self, message: str, ranks: list[int], phase: str = "run", run_dir: str | None = None,
                 waiting: list[int] | None = None):
        super().__init__(message, {rank: "still running at the timeout" for rank in ranks}, run_dir)
        self.phase = phase
        self.waiting = list(waiting or [])


class WorkerBaseException(RuntimeError):
    """What a launched worker raises in place of a BaseException that is neither an Exception nor
    SystemExit (KeyboardInterrupt, GeneratorExit, a class of the user's), chained to it: elastic
    records no error for those, and torch's spawn wrapper ends a process that raised
    KeyboardInterrupt with exit code 0, as if it had succeeded, so the launcher learnt of the
    failure only when it gave up waiting for the rank's result. Raised as this, it is recorded
    as any error is (the traceback names the original type) and the process exits with code 1.
    """
