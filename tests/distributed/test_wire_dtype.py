"""Muon's default wire (``comm_dtype="auto"``): FSDP2 with the defaults equals one process.

A small MLP whose gradients are low-rank (2 rows per rank), on 2 and 3 gloo ranks (uneven shards:
10 rows on 3 ranks are 4, 4, 2). Until the default followed the Newton-Schulz dtype, bf16 on the
wire under fp32 iterates (``ns_dtype="auto"`` on a CPU without native bf16, and the small matrices
of one with it) moved these matrices 0.08-0.29 of their displacement away from one process's.
Run as on the other kind of CPU with ``PYTHONPATH=tools/cpu_kind/native_bf16``: the (96, 40) and
(40, 96) batches then iterate and travel in bf16, the others in fp32.
"""

import pytest

from muonlab.launcher import launch
from muonlab.kernels.newton_schulz import cpu_has_native_bf16

from . import _workers_wire as W
from ._common import cloned, rel_displacement

EXACT = 1e-6
"""The default wire, with one process's gradients: equal (0.0 measured on both kinds of CPU)."""
DATA_PARALLEL = 1e-4
"""fp32 Newton-Schulz, the default wire, FSDP2's own backward on each rank's rows: the gradients
differ from one process's by the rounding of their reduction, which Newton-Schulz lifts in the
near-null directions (7e-6 to 9e-6 measured)."""
BF16_WIRE_AT_LEAST = 0.03
"""What a bf16 wire under fp32 iterates costs here (0.08-0.29 of a matrix's displacement
measured): the tests above would not see a coarser wire if this failed."""


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def world_results(request):
    world = request.param
    return world, launch(W.runs, world, timeout_s=400)


def _errors(got: dict, ref: dict, start: dict) -> tuple[float, dict]:
    """Relative displacement over every parameter, and per weight matrix."""
    per_matrix = {n: rel_displacement({n: got[n]}, {n: ref[n]}, {n: start[n]}) for n in ref if ref[n].dim() == 2}
    return rel_displacement(got, ref, start), per_matrix


@pytest.mark.timeout(900)
def test_fsdp2_with_the_defaults_equals_one_process(world_results):
    world, results = world_results
    start = cloned(W.build_mlp().named_parameters())
    for rank, res in results.items():
        err, per_matrix = _errors(res[("global", "defaults")]["params"], res["defaults"], start)
        assert err <= EXACT and max(per_matrix.values()) <= EXACT, (world, rank, per_matrix)
        err, per_matrix = _errors(res[("rows", "fp32_ns")]["params"], res["fp32_ns"], start)
        assert err <= DATA_PARALLEL, (world, rank, per_matrix)
        # the same runs with bf16 on the wire: far from one process, so the checks above can fail
        for grads, options, ref in [("global", "bf16_wire", "defaults"), ("rows", "fp32_ns_bf16_wire", "fp32_ns")]:
            err, per_matrix = _errors(res[(grads, options)]["params"], res[ref], start)
            assert err >= BF16_WIRE_AT_LEAST, (world, rank, grads, options, per_matrix)


@pytest.mark.timeout(900)
def test_each_batch_travels_in_its_newton_schulz_dtype_and_counts_those_bytes(world_results):
    """plan() and resolved_choices() give each batch's wire dtype: its Newton-Schulz dtype under
    the defaults (both kinds where the CPU has native bf16), bf16 everywhere under
    comm_dtype=torch.bfloat16; the step moves the bytes the plan counts."""
    world, results = world_results
    for rank, res in results.items():
        defaults, bf16_wire = res[("global", "defaults")], res[("global", "bf16_wire")]
        wire = {shape: (dtype, wire) for shape, dtype, wire in defaults["choices"]}
        assert all(dtype == wire for dtype, wire in wire.values()), wire
        if cpu_has_native_bf16():  # the workers see the parent's kind of CPU
            assert wire[(96, 40)] == wire[(40, 96)] == ("bfloat16", "bfloat16"), wire
            assert wire[(40, 40)] == wire[(10, 40)] == ("float32", "float32"), wire
        else:
            assert set(wire.values()) == {("float32", "float32")}, wire
        itemsize = {"bfloat16": 2, "float32": 4}
        assert {shape: size for shape, _, size, _ in defaults["plan"]} == {s: itemsize[w] for s, (_, w) in wire.items()}
        assert {size for _, _, size, _ in bf16_wire["plan"]} == {2}
        assert {wire for _, _, wire in bf16_wire["choices"]} == {"bfloat16"}
        # an fp32 batch moves twice the bytes of the same batch in bf16 (same paths, same owners)
        for (shape, path, size, total), (shape16, path16, _, total16) in zip(defaults["plan"], bf16_wire["plan"]):
            assert (shape, path) == (shape16, path16)
            assert total == total16 * size // 2, (shape, total, total16)
        for case in W.CASES:
            assert res[case]["sent"] == res[case]["plan_sent"] > 0, (rank, case)
    plans = [res[("global", "defaults")]["plan"] for res in results.values()]
    assert all(p == plans[0] for p in plans)
