"""Each batch's wire dtype (``comm_dtype``, muonlab.comm.wire) in plans: bytes, waves, choices."""

import dataclasses
import importlib

import pytest
import torch

from muonlab import Muon
from muonlab.comm.cost import get_profile
from muonlab.comm.planner.coalesce import coalesce
from muonlab.comm.records import Plan
from muonlab.comm.wire import itemsize_rule, wire_dtype
from muonlab.simulate import simulate

ns = importlib.import_module("muonlab.kernels.newton_schulz")
BIG, SMALL, SQUARE = (256, 256), (10, 40), (40, 40)
"""On a CPU with native bf16 "auto" computes BIG in bf16 (above CPU_FP32_MAX_WORK), the others in fp32."""
SHAPES = [("big", BIG), ("small", SMALL), ("square", SQUARE)]


def _by_shape(plan) -> dict:
    return {b.matrix_shape: (b.comm_itemsize, b.total_bytes) for b in plan}


@pytest.mark.parametrize("native", [True, False], ids=["native_bf16", "no_bf16"])
def test_plan_bytes_per_batch_follow_its_wire_dtype(monkeypatch, native):
    """Under the default each batch travels in its Newton-Schulz dtype on the run's device; an fp32
    batch counts twice the bytes of the same batch in bf16; an explicit dtype applies to all."""
    monkeypatch.setattr(ns, "cpu_has_native_bf16", lambda: native)
    auto = _by_shape(simulate(SHAPES, 3, ns_dtype="auto", device="cpu"))
    bf16 = _by_shape(simulate(SHAPES, 3, ns_dtype="auto", device="cpu", comm_dtype=torch.bfloat16))
    fp32 = _by_shape(simulate(SHAPES, 3, ns_dtype="auto", device="cpu", comm_dtype=torch.float32))
    assert {s: size for s, (size, _) in auto.items()} == {BIG: 2 if native else 4, SMALL: 4, SQUARE: 4}
    assert {size for size, _ in bf16.values()} == {2} and {size for size, _ in fp32.values()} == {4}
    for shape, (size, nbytes) in auto.items():
        assert nbytes > 0 and fp32[shape][1] == 2 * bf16[shape][1]
        assert nbytes == (bf16 if size == 2 else fp32)[shape][1]


def test_simulate_without_a_device_takes_the_gpu_rule_and_explicit_dtypes():
    """No device: "auto" Newton-Schulz is bf16, so is the default wire (the plan of an explicit
    bf16 wire); fp32 Newton-Schulz travels in fp32 unless bf16 is asked for."""
    default = simulate(SHAPES, 4, ns_dtype="auto")
    assert default == simulate(SHAPES, 4, ns_dtype="auto", comm_dtype=torch.bfloat16)
    assert {b.wire_dtype for b in default} == {torch.bfloat16}
    fp32_ns = simulate(SHAPES, 4, ns_dtype=torch.float32)
    assert {b.wire_dtype for b in fp32_ns} == {torch.float32}
    coarse = simulate(SHAPES, 4, ns_dtype=torch.float32, comm_dtype=torch.bfloat16)
    assert [2 * b.total_bytes for b in coarse] == [b.total_bytes for b in fp32_ns]
    # the reference strategies count their bytes at the same per-batch size
    xtuner = simulate(SHAPES, 4, strategy="xtuner", ns_dtype=torch.float32)
    assert {b.comm_itemsize for b in xtuner} == {4}
    # ns_dtype=None computes in what it reads, the parameters' dtype: bf16 parameters travel in bf16
    model = torch.nn.Sequential(torch.nn.Linear(40, 40, bias=False), torch.nn.Linear(40, 10, bias=False))
    model[1].to(torch.bfloat16)
    wire = {b.matrix_shape: b.wire_dtype for b in simulate(model, 2, ns_dtype=None)}
    assert wire == {SQUARE: torch.float32, SMALL: torch.bfloat16}


def test_muon_plans_and_shows_each_batch_wire_dtype_as_simulate_does(monkeypatch):
    monkeypatch.setattr(ns, "cpu_has_native_bf16", lambda: True)
    params = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in SHAPES]
    opt = Muon(params)
    assert opt.comm_dtype == "auto"
    sizes = {b.matrix_shape: b.comm_itemsize for b in opt.plan()}
    assert sizes == {BIG: 2, SMALL: 4, SQUARE: 4}
    assert sizes == {b.matrix_shape: b.comm_itemsize for b in simulate(SHAPES, 1, ns_dtype="auto", device="cpu")}
    rows = {r["shape"]: (r["dtype"], r["wire_dtype"]) for r in opt.resolved_choices()}
    assert rows == {BIG: ("bfloat16", "bfloat16"), SMALL: ("float32", "float32"), SQUARE: ("float32", "float32")}
    opt.comm_dtype = torch.bfloat16  # a new options record: a new plan
    assert {b.comm_itemsize for b in opt.plan()} == {2}
    assert {r["wire_dtype"] for r in opt.resolved_choices()} == {"bfloat16"}
    # ns_dtype=None: the momentum's dtype (fp32 momentum for bf16 parameters travels in fp32)
    bf16_params = [(n, torch.nn.Parameter(torch.randn(s, dtype=torch.bfloat16))) for n, s in SHAPES]
    assert {b.comm_itemsize for b in Muon(bf16_params, ns_dtype=None).plan()} == {2}
    assert {b.comm_itemsize for b in Muon(bf16_params, ns_dtype=None, momentum_dtype=torch.float32).plan()} == {4}


def test_a_wave_never_mixes_wire_dtypes():
    """Small batches share one collective per direction (a wave), which carries one dtype."""
    shapes = [(f"w{k}", (8, 4 + k)) for k in range(4)]
    profile = get_profile("cpu_gloo")
    plan = simulate(shapes, 4, profile=profile, comm_dtype=torch.float32)
    assert len({b.travels_with for b in plan}) == 1 and plan[0].travels_with is not None  # one wave of 4
    alone = Plan(tuple(dataclasses.replace(b, travels_with=None) for b in plan))
    assert coalesce(alone, profile) == plan
    mixed = list(alone)
    mixed[2] = dataclasses.replace(mixed[2], comm_itemsize=2)
    # the first two still travel together; the third alone, and so the fourth (no neighbour left)
    assert [b.travels_with for b in coalesce(Plan(tuple(mixed)), profile)] == [0, 0, None, None]


def test_wire_dtype_rules_and_refusals():
    assert wire_dtype("auto", torch.bfloat16) is torch.bfloat16
    for compute in (torch.float32, torch.float64, torch.float16):  # fp16 can't travel; bf16 would coarsen it
        assert wire_dtype("auto", compute) is torch.float32
    assert wire_dtype(torch.bfloat16, torch.float32) is torch.bfloat16
    assert itemsize_rule(4)(None, None) == 4
    with pytest.raises(ValueError, match="no wire dtype has 3 bytes"):
        itemsize_rule(3)
    with pytest.raises(TypeError, match="comm_itemsize must be an int"):
        itemsize_rule(True)
    for bad, exc in [("bf16", TypeError), (torch.float16, ValueError), (None, TypeError)]:
        with pytest.raises(exc, match="comm_dtype must be"):
            Muon([torch.nn.Parameter(torch.randn(4, 8))], comm_dtype=bad)
        with pytest.raises(exc, match="comm_dtype must be"):
            simulate(SHAPES, 2, comm_dtype=bad)
