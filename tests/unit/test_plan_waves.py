"""Waves (muonlab.comm.planner.coalesce): which batches travel together, and what the cost model says."""

from dataclasses import replace

import pytest

from muonlab.comm.cost import comm_seconds, get_profile, step_seconds
from muonlab.comm.planner import plan_batches
from muonlab.comm.planner.coalesce import coalesce, latency_bound
from muonlab.comm.records import Plan
from muonlab.comm.specs import GroupKey, MatrixSpec, chunk_sizes
from muonlab.kernels.config import NSConfig
from muonlab.models import GPT, GPTConfig
from muonlab.simulate import simulate

CPU = get_profile("cpu_gloo")
NO_LATENCY = replace(CPU, name="no_latency", latency_s=0.0)


def _row_specs(shapes, size, axis="dp"):
    g = GroupKey(mesh_ranks=tuple(range(size)), mesh_shape=(size,), axis_name=axis)
    return [MatrixSpec(i, f"m{i}", s, "row_shard", g, chunk_sizes(s[0], size)) for i, s in enumerate(shapes)]


def _waves(plan) -> list[list[int]]:
    out: dict[int, list[int]] = {}
    for b in plan:
        if b.travels_with is not None:
            out.setdefault(b.travels_with, []).append(b.index)
    return list(out.values())


@pytest.mark.parametrize("world", [2, 4])
def test_the_small_gpt_travels_as_one_wave_on_gloo_and_alone_without_latency(world):
    model = GPT(GPTConfig(d_model=8, n_layers=12, n_heads=2))
    plan = simulate(model, world, profile="cpu_gloo", workspace_bytes=8 << 20)
    assert _waves(plan) == [[b.index for b in plan]] and len(plan) == 4
    assert [b.pays_latency for b in plan] == [True, False, False, False]
    alone = simulate(model, world, profile=NO_LATENCY, workspace_bytes=8 << 20)
    assert all(b.travels_with is None and b.pays_latency for b in alone)
    assert [replace(b, travels_with=None) for b in plan] == list(alone)  # the same batches otherwise


def test_large_matrices_never_join_a_wave_and_split_the_small_ones_around_them():
    shapes = [(8, 8)] * 4 + [(1024, 1024)] * 4 + [(8, 16)] * 4 + [(16, 8)] * 4
    plan = plan_batches(_row_specs(shapes, 2), [NSConfig()] * len(shapes), profile=CPU)
    big = [b for b in plan if b.matrix_shape == (1024, 1024)]
    assert big and all(b.travels_with is None and not latency_bound(b, CPU) for b in big)
    for wave in _waves(plan):
        assert wave == list(range(wave[0], wave[0] + len(wave)))  # consecutive batches only
        assert all(plan[i].matrix_shape != (1024, 1024) for i in wave)


def test_batches_on_different_groups_or_paths_do_not_share_a_wave():
    specs = _row_specs([(8, 8)] * 4, 2, "a") + [replace(s, index=4 + s.index, name=f"n{s.index}")
                                                for s in _row_specs([(16, 8)] * 4, 2, "b")]
    plan = plan_batches(specs, [NSConfig()] * 8, profile=CPU)
    for wave in _waves(plan):
        assert len({plan[i].group for i in wave}) == 1
    assert coalesce(Plan(tuple(replace(b, path="agrs") for b in plan)), CPU).batches == tuple(
        replace(b, path="agrs", travels_with=None) for b in plan)


def test_the_cost_model_charges_a_wave_its_latency_once():
    model = GPT(GPTConfig(d_model=8, n_layers=12, n_heads=2))
    waves = simulate(model, 2, profile="cpu_gloo")
    alone = Plan(tuple(replace(b, travels_with=None) for b in waves))
    assert comm_seconds(waves[1], CPU) == pytest.approx(comm_seconds(alone[1], CPU) - 2 * CPU.latency_s)
    saved = step_seconds(alone, CPU) - step_seconds(waves, CPU)
    assert saved == pytest.approx(3 * 2 * CPU.latency_s, rel=0.05)  # three batches' collective pairs
