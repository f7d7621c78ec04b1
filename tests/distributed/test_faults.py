"""Faults injected into launched Muon training workers (gloo on CPU).

Each fault must end in the caller as a WorkerError (or WorkerTimeout) naming the faulty rank,
within the launch's timeout once the workers are up (the process group's collective timeout is
the same timeout_s), with
no worker process left, and a following launch in this process must succeed. test_launch.py
covers launch's own failures (a plain raise, a plain hang); here the faults sit inside training:
before the first optimizer step, inside Muon.step between collectives, a SIGKILL, ranks that
disagree on a parameter's shape, a hang inside a step.
"""

from __future__ import annotations

import os
import time

import pytest

from muonlab.launcher import WorkerError, WorkerTimeout, launch
from tests.distributed import _workers_faults as F

pytestmark = pytest.mark.cold_launch  # a fault ends the workers; the launch after it starts fresh ones

# fault -> (world, timeout_s, first rank named, text the message must hold, timeout expected)
FAULTS = {
    "raise_before": (2, 60, 1, "injected fault before the first optimizer step", False),
    "raise_in_step": (2, 60, 1, "injected fault inside Muon.step (newton_schulz)", False),
    # the killed rank is named (see test_sigkilled_rank_is_named_first_with_its_signal for how)
    "sigkill": (4, 60, None, "--- rank 2 ---", False),
    "shape": (2, 60, None, "ranks disagree on the step: muon parameter 'w': shape (4, 8) on rank 0, "
                           "(4, 9) on rank 1", False),
    "hang_in_step": (2, 10, 0, "timed out after 10 s", True),  # two steps before the hang: well within 10 s
    # the other rank waits for the hung one in a collective of the step: only the hung one is named
    "hang_in_step_rank1": (2, 10, 1, "rank 1 still running, not inside a collective; rank 0 waited", True),
}
SURVIVED: list[str] = []
ERRORS: dict[str, WorkerError] = {}


def _assert_gone(pids) -> None:
    deadline = time.monotonic() + 5
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, f"worker pid {pid} still exists"
            time.sleep(0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_surfaces_as_a_clear_error_naming_the_rank(fault, tmp_path):
    world, timeout_s, rank, text, is_timeout = FAULTS[fault]
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(F.train_with_fault, world, fault, str(tmp_path), timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    err = info.value
    message = str(err)
    assert isinstance(err, WorkerTimeout) == is_timeout, message
    # timeout_s counts from when every rank is up (start-up has its own clock); the workers write
    # their pids once up
    up_for = time.time() - max(p.stat().st_mtime for p in tmp_path.glob("rank*.pid"))
    assert up_for < timeout_s + 15, (elapsed, up_for)
    assert text in message, message
    if is_timeout:  # the rank that hung alone, the other waiting for it in a collective
        assert (err.ranks, err.waiting) == ([rank], [1 - rank]), message
    if rank is not None:
        assert err.ranks[0] == rank, message
        assert message.startswith(f"rank {rank} of {world}") or is_timeout, message
    elif fault == "shape":  # every rank sees the disagreement and says which ranks differ
        assert set(err.ranks) == set(range(world)), message
    else:
        assert 2 in err.ranks, message
    ERRORS[fault] = err
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == world
    _assert_gone(pids)
    SURVIVED.append(f"{fault}: {type(err).__name__} naming rank(s) {err.ranks} after {elapsed:.1f} s")


@pytest.mark.timeout(120)
def test_sigkilled_rank_is_named_first_with_its_signal(tmp_path):
    err = ERRORS.get("sigkill")
    if err is None:  # run alone: provoke the kill here rather than pass without checking
        world, timeout_s = FAULTS["sigkill"][:2]
        with pytest.raises(WorkerError) as info:
            launch(F.train_with_fault, world, "sigkill", str(tmp_path), timeout_s=timeout_s)
        err = info.value
    assert err.ranks[0] == 2 and "killed by signal SIGKILL" in err.failures[2], str(err)


@pytest.mark.timeout(120)
def test_launch_after_the_faults_succeeds(tmp_path):
    results = launch(F.train_with_fault, 2, "none", str(tmp_path), timeout_s=90)
    assert results == {0: 0, 1: 1}
    _assert_gone(int(p.read_text()) for p in tmp_path.glob("rank*.pid"))
    print(f"\nfault summary: {len(SURVIVED)} of {len(FAULTS)} faults surfaced as clear errors, then a clean launch")
    for line in SURVIVED:
        print("  " + line)
