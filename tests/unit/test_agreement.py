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


def test_gradient_fingerprints_are_exact_for_equal_bits_and_tell_one_ulp_apart():
    """Bit-identical gradients give equal fingerprints whatever their layout or the thread count
    (an integer sum: any order); one changed bit, a sign, or another tensor changes them."""
    import torch

    from muonlab.optim.replicas import fingerprints, fold

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 48, generator=gen), torch.randn(16, 8, generator=gen).bfloat16(),
             torch.randn(8, 8, generator=gen).half(), torch.randn(5, 7, generator=gen).double()]
    base = fingerprints(grads)
    assert base.dtype == torch.int32 and base.shape == (4,)
    laid_out = [g.t().contiguous().t() for g in grads]  # same values, column-major
    assert not laid_out[0].is_contiguous() and torch.equal(fingerprints(laid_out), base)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fingerprints([g.clone() for g in grads]), base)
    finally:
        torch.set_num_threads(threads)
    for k, g in enumerate(grads):
        for change in ("ulp", "sign", "other"):
            other = [x.clone() for x in grads]
            if change == "ulp":
                other[k].view(-1)[3] = torch.nextafter(g.view(-1)[3], torch.tensor(float("inf"), dtype=g.dtype))
            elif change == "sign":
                other[k].view(-1)[5] = -g.view(-1)[5]
            else:
                other[k] = torch.randn(g.shape, generator=gen).to(g.dtype)
            got = fingerprints(other)
            assert got[k] != base[k] and torch.equal(torch.cat([got[:k], got[k + 1:]]),
                                                     torch.cat([base[:k], base[k + 1:]])), (k, change)
            assert fold(got.tolist()) != fold(base.tolist())
    assert fold(base.tolist()) == fold(list(base.tolist())) and 0 <= fold(base.tolist()) < 2**63


def test_the_fingerprints_are_read_with_the_non_finite_flag():
    """One read: the flag, then the values (a NaN still flagged, whatever the fingerprint)."""
    import torch

    from muonlab.optim import nonfinite
    from muonlab.optim.replicas import fingerprints

    grads = [torch.randn(6, 4), torch.randn(3, 3)]
    values, read = fingerprints(grads[:1]), []
    assert not nonfinite.found(grads, values, read) and read == values.tolist()
    grads[0][1, 1] = float("inf")
    assert nonfinite.found(grads, values, read) and read == values.tolist() and nonfinite.found(grads)
    grads[0][1, 1], grads[1][2, 0] = 0.0, float("nan")  # in a gradient not fingerprinted
    assert nonfinite.found(grads, values, read)
