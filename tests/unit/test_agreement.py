"""muonlab.optim.agreement's words and digest, without processes (the check itself runs across gloo
ranks in tests/distributed/test_agreement.py)."""

from muonlab.optim.agreement import digest, first_difference

A = [("muon", "w0", (("shape", (8, 16)), ("lr", 0.02), ("newton_schulz", "cfg5"))),
     ("adamw", "bias", (("shape", (8,)), ("lr", 3e-4))),
     ("options", "", (("nonfinite", "skip"),))]


def test_the_digest_is_stable_and_tells_descriptions_apart():
    assert digest(A) == digest([tuple(x) for x in A]) and 0 <= digest(A) < 2**63
    assert digest(A) != digest(A[:2]) and digest(A) != digest([A[1], A[0], A[2]])


def test_the_first_difference_is_named_in_words():
    lr = [("muon", "w0", (("shape", (8, 16)), ("lr", 0.04), ("newton_schulz", "cfg5"))), *A[1:]]
    assert first_difference([A, A, lr], [0, 1, 2]) == \
        "ranks disagree on the step: muon parameter 'w0': lr 0.02 on rank 0, 0.04 on rank 2"
    steps = [("muon", "w0", (("shape", (8, 16)), ("lr", 0.02), ("newton_schulz", "cfg6"))), *A[1:]]
    assert "newton_schulz 'cfg5' on rank 0, 'cfg6' on rank 1" in first_difference([A, steps], [0, 1])
    assert first_difference([A, [A[0], A[2]]], [0, 1]) == (
        "ranks disagree on the step: adamw parameter 'bias' has a gradient on rank 0 and none on rank 1 "
        "(every rank must step the same parameters; a gradient of None skips one)")
    extra = [*A, ("muon", "w9", (("shape", (4, 4)),))]
    assert first_difference([A, extra], [0, 1]) == \
        "ranks disagree on the step: muon parameter 'w9' has a gradient on rank 1 and none on rank 0"
    assert "different orders" in first_difference([A, [A[1], A[0], A[2]]], [3, 5])
