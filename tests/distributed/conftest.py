"""The distributed suite runs gloo on the CPU on every machine.

Its checks compare workers' CPU tensors with single-process CPU references, and several launch
more ranks than a GPU node may have GPUs, so on a GPU node the device rule would change what they
test. Every test here therefore runs with ``MUONLAB_DEVICE=cpu`` (inherited by the workers it
launches), except those marked ``auto_device``, which see the machine's own rule (the CUDA tests).
"""

import pytest

from muonlab.distributed.device import DEVICE_ENV


def pytest_configure(config):
    config.addinivalue_line("markers", "auto_device: run without the MUONLAB_DEVICE=cpu pin of tests/distributed")


@pytest.fixture(autouse=True)
def _cpu_workers(request, monkeypatch):
    if request.node.get_closest_marker("auto_device"):
        monkeypatch.delenv(DEVICE_ENV, raising=False)
    else:
        monkeypatch.setenv(DEVICE_ENV, "cpu")


@pytest.fixture(autouse=True, scope="session")
def _runs_in_a_temporary_directory(tmp_path_factory):
    """launch() keeps each run's logs under $MUONLAB_RUNS_DIR (default ./runs); the suite's runs go
    to a temporary directory instead of the checkout."""
    from muonlab.distributed.launch import RUNS_DIR_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUNS_DIR_ENV, str(tmp_path_factory.mktemp("runs")))
        yield


@pytest.fixture
def launches_started(monkeypatch) -> list:
    """elastic's launcher replaced by a recorder: the launches that got as far as starting workers
    (empty for a launch() refused before anything starts)."""
    import sys

    started = []
    monkeypatch.setattr(sys.modules["muonlab.distributed.launch"], "elastic_launch", lambda *a, **k: started.append(a))
    return started
