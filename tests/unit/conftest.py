"""Settings for the unit tests."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def _run_records_in_a_temporary_directory(tmp_path_factory):
    """train and compare keep a run record by default under $MUONLAB_RUNS_DIR (default ./runs): the
    unit tests' records go to a temporary directory, not the checkout. Per module (autouse: set up
    before a module's own fixtures, which train too), not per session: on an xdist worker the
    notebooks run after these tests in the same process, and their kernels must see the
    environment a researcher's has."""
    from muonlab.runs import RUNS_DIR_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUNS_DIR_ENV, str(tmp_path_factory.mktemp("runs")))
        yield
