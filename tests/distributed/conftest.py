"""The distributed suite runs gloo on the CPU on every machine.

Its checks compare workers' CPU tensors with single-process CPU references, and several launch
more ranks than a GPU node may have GPUs, so on a GPU node the device rule would change what they
test. Every test here therefore runs with ``MUONLAB_DEVICE=cpu`` (inherited by the workers it
launches), except those marked ``auto_device``, which see the machine's own rule (the CUDA tests).

Launches reuse warm workers (``MUONLAB_WARM_WORKERS=1``): a cold launch spends a second or more
starting processes (forked from a forkserver that imported torch once) and connecting them, and the
suite launches about a hundred times. A task sees what a
fresh worker would (muonlab.launcher.warm resets it), and a failing one takes the pool down.
Modules marked ``cold_launch`` test the launcher itself, or need new processes (a resume read
from disk alone), and launch cold.
"""

import pytest

from muonlab.distributed.device import DEVICE_ENV
from muonlab.launcher import WARM_ENV, shutdown_workers


def pytest_configure(config):
    config.addinivalue_line("markers", "auto_device: run without the MUONLAB_DEVICE=cpu pin of tests/distributed")
    config.addinivalue_line("markers", "cold_launch: launch() without warm= starts new workers (MUONLAB_WARM_WORKERS=0)")


@pytest.fixture(autouse=True)
def _cpu_workers(request, monkeypatch):
    if request.node.get_closest_marker("auto_device"):
        monkeypatch.delenv(DEVICE_ENV, raising=False)
    else:
        monkeypatch.setenv(DEVICE_ENV, "cpu")
    if request.node.get_closest_marker("cold_launch"):
        monkeypatch.setenv(WARM_ENV, "0")


@pytest.fixture(autouse=True, scope="package")
def _runs_in_a_temporary_directory(tmp_path_factory):
    """launch() keeps each run's logs under $MUONLAB_RUNS_DIR (default ./runs); this package's runs
    go to a temporary directory instead of the checkout. Package scope, not session: on an xdist
    worker the notebooks run after these tests in the same process, and their kernels must see
    the environment a researcher's has."""
    from muonlab.launcher import RUNS_DIR_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUNS_DIR_ENV, str(tmp_path_factory.mktemp("runs")))
        yield


@pytest.fixture(autouse=True, scope="package")
def _warm_cpu_workers():
    """While this package's tests run (not after: the unit tests see the machine as it is), launches
    are warm and on CPU workers; the pool ends with the package."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(WARM_ENV, "1")
        mp.setenv(DEVICE_ENV, "cpu")  # module-scoped fixtures launch before _cpu_workers runs
        yield
    shutdown_workers()


@pytest.fixture
def launches_started(monkeypatch) -> list:
    """elastic's launcher replaced by a recorder: the launches that got as far as starting workers
    (empty for a launch() refused before anything starts)."""
    import sys

    started = []
    monkeypatch.setattr(sys.modules["muonlab.launcher.supervisor"], "elastic_launch", lambda *a, **k: started.append(a))
    return started
