"""The launcher: start distributed worker processes from a notebook or a script, or under torchrun.

One machine, from a notebook or a script::

    from muonlab.launcher import launch   # also muonlab.launch
    from mywork import train          # a function in an importable .py module

    results = launch(train, 4, steps=100)      # {rank: return value of train on that rank}

``launch`` starts ``nprocs`` processes through torch.distributed's own elastic launcher
(``elastic_launch``, a static rendezvous on a free port of 127.0.0.1; start method "forkserver"
where the platform has it, else "spawn", see ``start_method``),
initialises the default process group in each by the rule of :mod:`muonlab.distributed.device`
(rank ``r`` on ``cuda:r`` with NCCL when CUDA has a GPU per process, else gloo on the CPU;
``device="cpu"`` or ``$MUONLAB_DEVICE=cpu`` keeps CPU workers on a GPU node),
calls ``fn(*args, **kwargs)`` and hands back each rank's return value. Each rank's stdout and stderr
go to ``runs/<name>/rank<r>/`` (kept after the call), never to the notebook; what the workers report
with :func:`~muonlab.launcher.progress.report_progress` is shown while the call waits (a bar and
a live loss plot in a notebook, see :mod:`muonlab.launcher.progress`). A worker that raises gives a
:class:`WorkerError` carrying the worker's traceback and the path of its log;
a launch whose workers are not all up (process group initialised) within ``startup_timeout_s``, or
that runs past ``timeout_s`` seconds after that, is stopped, its processes killed, and gives a
:class:`WorkerTimeout` naming the phase. In a notebook kernel the workers are kept for the next
launch on the same ranks (warm workers, :mod:`muonlab.launcher.warm`; ``warm=`` and
:func:`shutdown_workers`). The worker function must live in a module the children can
import: a function defined in a notebook cell (module ``__main__``), a lambda or a nested function
is refused before anything starts. The children get the caller's ``sys.path``, so a ``.py`` file
next to the notebook is found, and its ``os.environ`` as it is at the launch. The children re-run the
caller's main script before they start (either start method): in a script, call ``launch`` under
``if __name__ == "__main__":`` (launch says so if it is not).

Several nodes (GPUs), with the same worker functions, under torchrun::

    torchrun --nnodes=N --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        -m muonlab.launcher mypkg.mymod:train [ARG ...]

Here ``python -m muonlab.launcher MODULE:FUNCTION [ARG ...]`` (:func:`worker_main`) runs in
every process torchrun starts: it initialises the default process group from torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; NCCL on ``cuda:LOCAL_RANK`` when CUDA
has a GPU per local rank, else gloo), calls ``FUNCTION(*ARGS)`` with the remaining command-line
words as strings, and destroys the group. ``--backend``, ``--device`` and ``--timeout-s`` may come before
``MODULE:FUNCTION``. From Python, :func:`run_worker` does the same for a function object. Errors are
recorded with torch.distributed.elastic's ``record``, so torchrun's summary shows the traceback.

The package, by module: :mod:`~muonlab.launcher.worker` (what runs inside a worker, and the torchrun
entry point), :mod:`~muonlab.launcher.supervisor` (the caller's side: :func:`launch`),
:mod:`~muonlab.launcher.run_dir` (the run directory and the status files both sides read),
:mod:`~muonlab.launcher.process_tools` (which processes are a launch's, ending them),
:mod:`~muonlab.launcher.warm` (the warm worker pool), :mod:`~muonlab.launcher.progress` (what
workers report and how the caller shows it), :mod:`~muonlab.launcher.errors`.

Why "launcher" and not "launch": ``muonlab.launch(fn, nprocs, ...)`` is a function (the README's,
the notebooks'). Importing a submodule binds the package as an attribute of its parent, so a
package ``muonlab/launch/`` would replace that function by a module the moment anything imported
``muonlab.launch.worker`` (every worker does). ``muonlab.distributed`` holds parallelism only
(meshes, FSDP2/DDP/EP, the device rule); the launcher sits above it, since it uses the device rule
to set up each worker's process group.
"""

from .errors import WorkerBaseException, WorkerError, WorkerTimeout
from .progress import report_progress
from .run_dir import LAUNCH_INFO, RUNS_DIR_ENV, last_launch_info
from .supervisor import BACKENDS, MAX_PROCS, MAX_TIMEOUT_S, START_METHODS, WARM_ENV, launch, shutdown_workers
from .worker import run_worker, worker_main

__all__ = [
    "BACKENDS",
    "LAUNCH_INFO",
    "MAX_PROCS",
    "MAX_TIMEOUT_S",
    "RUNS_DIR_ENV",
    "START_METHODS",
    "WARM_ENV",
    "WorkerBaseException",
    "WorkerError",
    "WorkerTimeout",
    "last_launch_info",
    "launch",
    "report_progress",
    "run_worker",
    "shutdown_workers",
    "worker_main",
]
