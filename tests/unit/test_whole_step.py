"""muonlab.trace.whole_step without a launch: FSDP2's collectives read from known profiler events,
the recorder's window and phases in one process, its refusals, and how whole steps are drawn and
exported (the 2-rank FSDP2 run: tests/distributed/test_whole_step.py)."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from muonlab import Muon, muon_param_groups  # noqa: E402
from muonlab.experiments.train import train_worker  # noqa: E402
from muonlab.trace import Span, WholeStepRecorder, to_chrome_trace  # noqa: E402
from muonlab.trace.step_time import exposed_comm_table, subtract  # noqa: E402
from muonlab.trace.whole_step import ProfiledEvent as E, fsdp_collective_spans  # noqa: E402
from muonlab.viz.timeline import _DIRECTION, PATH_COLORS, PHASE_COLORS, plot_timeline  # noqa: E402

MAIN, GLOO_A, GLOO_B = 1, 2, 3


def test_subtract_leaves_what_the_holes_do_not_cover():
    assert subtract([(0, 10), (12, 20)], [(-1, 1), (2, 3), (9, 13), (15, 16), (19, 25)]) == \
        [(1, 2), (3, 9), (13, 15), (16, 19)]
    assert subtract([(0, 10)], []) == [(0, 10)] and subtract([(0, 10)], [(0, 10)]) == []


def test_fsdp_collectives_from_known_events():
    events = [
        # a synchronous all-gather: copy-in, the c10d call, the wait for gloo's transfer
        E("FSDP::all_gather (blocks.0)", 1.0, 2.0, MAIN), E("c10d::_allgather_base_", 1.2, 1.3, MAIN),
        E("gloo:all_gather", 1.4, 1.9, GLOO_A),
        E("FSDP::all_gather_copy_out (blocks.0)", 2.0, 2.1, MAIN),
        # the optimizer's own collective between them claims its own transfer
        E("c10d::alltoall_base_", 3.0, 3.1, MAIN), E("gloo:all_to_all", 3.05, 3.5, GLOO_B),
        # an asynchronous all-gather: issued, left, waited for in the copy-out
        E("FSDP::all_gather (blocks.1)", 4.0, 4.2, MAIN), E("c10d::_allgather_base_", 4.1, 4.15, MAIN),
        E("gloo:all_gather", 4.16, 4.8, GLOO_A), E("FSDP::all_gather_copy_out (blocks.1)", 4.6, 4.9, MAIN),
        # a reduce-scatter (gloo runs it as all_reduce), with compute before and after the collective
        E("FSDP::post_backward_reduce (blocks.1)", 5.0, 6.0, MAIN), E("c10d::_reduce_scatter_base_", 5.3, 5.35, MAIN),
        E("gloo:all_reduce", 5.4, 5.8, GLOO_B),
        # one rank: FSDP2's range without a collective
        E("FSDP::all_gather", 7.0, 7.1, MAIN),
    ]
    spans, blocked = fsdp_collective_spans(events, MAIN)
    assert spans == [("all_gather", "fsdp_all_gather", 1.2, 1.9), ("all_gather", "fsdp_all_gather", 4.1, 4.8),
                     ("reduce_scatter", "fsdp_reduce_scatter", 5.3, 5.8)]
    # in FSDP2's ranges while one was in flight: not in the copy-in, nor between 4.2 and 4.6, when
    # the thread computed with the all-gather in flight, nor after the reduce-scatter's transfer
    assert [t for pair in blocked for t in pair] == pytest.approx([1.2, 1.9, 4.1, 4.2, 4.6, 4.8, 5.3, 5.8])


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(model, opt, steps):
    for k in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        torch.nn.functional.mse_loss(model(x), torch.zeros(4, 4)).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_recorder_keeps_its_window_of_whole_steps_in_order(optimizer):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters()) if optimizer == "adamw" else Muon(muon_param_groups(model))
    rec = WholeStepRecorder(model, opt, steps=2, skip=1, first_step=10)
    _train(model, opt, 1)
    assert not rec.done
    with pytest.raises(RuntimeError, match="1 of 3 steps"):
        rec.spans()
    _train(model, opt, 3)  # the window closes after its second step; the fourth step is not recorded
    assert rec.done and rec.completed == 4
    spans = rec.spans()
    assert sorted({s.step for s in spans}) == [11, 12]
    own = {"optimizer"} if optimizer == "adamw" else {"newton_schulz", "update", "adamw", "momentum"}
    for step in (11, 12):
        mine = [s for s in spans if s.step == step]
        names = [s.name for s in mine]
        assert names[0] == "forward" and names[1] == "backward" and own <= set(names[2:])
        assert all(a.end <= b.start for a, b in zip(mine[:2], mine[1:3]))
        assert not any(s.path.startswith("fsdp") for s in mine)  # no FSDP2 here
    first = max(s.end for s in spans if s.step == 11)
    assert first <= min(s.start for s in spans if s.step == 12)
    rec.detach()
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_window_without_a_forward_of_the_model_is_over_and_empty():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = WholeStepRecorder(model, opt, steps=2)
    for _ in range(2):  # steps of another model's loss: this model never runs forward
        opt.step()
    assert rec.done and rec.spans() == []


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(steps=0), ValueError, r"^steps must"),
    (dict(steps=2, skip=-1), ValueError, r"^skip must"),
    (dict(steps=2, first_step=1.5), ValueError, r"^first_step must"),
    (dict(steps=2, model=object()), TypeError, r"^model must"),
    (dict(steps=2, optimizer=object()), TypeError, r"^optimizer must"),
])
def test_recorder_refuses_bad_arguments_before_attaching(kwargs, error, match):
    model = _mlp()
    args = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), **kwargs}
    with pytest.raises(error, match=match):
        WholeStepRecorder(args.pop("model"), args.pop("optimizer"), **args)
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("value, match", [(-1, r"^whole_step_timeline must be a whole"),
                                          (3, r"^whole_step_timeline must be at most steps=2")])
def test_train_worker_refuses_a_window_it_cannot_record(value, match):
    with pytest.raises(ValueError, match=match):  # before any process group or model is needed
        train_worker(steps=2, whole_step_timeline=value)


def _whole_step(rank: int = 0) -> list[Span]:
    return [Span("forward", 0.0, 1.0, rank=rank, step=0),
            Span("all_gather", 1.0, 2.0, rank=rank, path="fsdp_all_gather", step=0),
            Span("forward", 2.0, 3.0, rank=rank, step=0), Span("backward", 3.0, 4.0, rank=rank, step=0),
            Span("reduce_scatter", 4.0, 5.0, rank=rank, path="fsdp_reduce_scatter", step=0),
            Span("newton_schulz", 5.0, 6.0, rank=rank, batch=0, path="all_to_all", step=0),
            Span("comm_out", 5.5, 6.5, rank=rank, batch=0, path="all_to_all", bytes_sent=8, step=0)]


def test_whole_steps_drawn_with_their_phases_and_kinds_and_no_byte_outlines():
    ax = plot_timeline(_whole_step() + _whole_step(1))
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"forward", "backward", "comm: fsdp_all_gather", "comm: fsdp_reduce_scatter"} <= set(legend)
    assert "no bytes on this rank" not in legend  # FSDP2's collectives count no bytes: never outlined
    assert ax.get_title().startswith("one training step")
    # exposed per kind: FSDP2's collectives covered by no compute, all_to_all half under Newton-Schulz
    table = {r["path"]: r for r in exposed_comm_table(_whole_step())}
    assert table["fsdp_all_gather"]["exposed_ms"] == table["fsdp_reduce_scatter"]["exposed_ms"] == 1e3
    assert table["all_to_all"]["overlap_share"] == 0.5 and table["all"]["exposed_ms"] == 2.5e3


def test_every_phase_and_path_colour_is_told_apart():
    colors = {**PHASE_COLORS, **{f"comm: {p}": c for p, c in PATH_COLORS.items()}, "direction": _DIRECTION}
    rgb = {name: matplotlib.colors.to_rgb(c) for name, c in colors.items()}
    names = sorted(rgb)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert max(abs(x - y) for x, y in zip(rgb[a], rgb[b])) > 0.12, (a, b)


def test_chrome_trace_gives_each_fsdp_kind_a_thread():
    trace = to_chrome_trace(_whole_step())
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["comm batch 0", "comm fsdp_all_gather", "comm fsdp_reduce_scatter", "compute",
                                        "training step"]
    by_name = {e["name"]: threads[e["tid"]] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert by_name["forward"] == by_name["backward"] == "compute"
    assert by_name["reduce_scatter[fsdp_reduce_scatter]"] == "comm fsdp_reduce_scatter"
