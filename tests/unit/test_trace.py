from muonlab.trace import Span, Tracer, to_chrome_trace


def test_chrome_trace_threads_hold_only_nested_events():
    # two batches whose communication overlaps in time, as the engine's pipeline produces
    spans = [Span("comm_out", 0.0, 1.0, rank=0, path="all_to_all", batch=0),
             Span("comm_out", 0.5, 1.5, rank=0, path="all_to_all", batch=1),
             Span("newton_schulz", 1.0, 2.0, rank=0, path="all_to_all", batch=0),
             Span("comm_back", 2.0, 3.0, rank=0, path="all_to_all", batch=0),
             Span("comm_out", 0.0, 1.0, rank=1, path="all_to_all", batch=0)]
    trace = to_chrome_trace(spans)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    by_thread = {}
    for e in events:
        by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for intervals in by_thread.values():
        intervals.sort()
        for (s1, e1), (s2, e2) in zip(intervals, intervals[1:]):
            assert s2 >= e1 or e2 <= e1  # disjoint or nested
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"rank 0", "rank 1", "compute", "comm batch 0", "comm batch 1"} <= names


def test_tracer_records_spans_in_order():
    t = Tracer(rank=3)
    with t.span("momentum"):
        pass
    t.add("comm_out", 1.0, 2.0, path="owner", batch=0, bytes_sent=10)
    assert [s.name for s in t.spans] == ["momentum", "comm_out"] and t.spans[1].duration == 1.0
    assert all(s.rank == 3 for s in t.spans)
    t.reset()
    assert t.spans == []


def test_the_log_folds_into_the_spans_and_tallies_add_and_tally_make_in_recording_order():
    """What the hot step appends to ``Tracer.log`` reads back as ``add`` and ``tally`` record it,
    interleaved with them in recording order; a new log list starts a new step."""
    direct, logged = Tracer(rank=1), Tracer(rank=1)
    direct.add("momentum", 0.0, 1.0, batch=0)
    direct.tally("communication", 1.0, 1.5, 2.0, 2.25)
    direct.add("newton_schulz", 1.5, 2.0, path="local", batch=0)
    with direct.span("update", batch=0):
        pass
    logged.log.append(("momentum", 0.0, 1.0, {"batch": 0}))
    logged.log.extend((("communication", 1.0, 1.5, None), ("communication", 2.0, 2.25, None)))
    assert [s.name for s in logged.spans] == ["momentum"]  # read halfway: the rest folds later, after it
    logged.log.append(("newton_schulz", 1.5, 2.0, {"path": "local", "batch": 0}))
    with logged.span("update", batch=0):
        pass
    assert [(s.name, s.start, s.end, s.rank, s.path, s.batch) for s in logged.spans][:2] == \
        [(s.name, s.start, s.end, s.rank, s.path, s.batch) for s in direct.spans][:2]  # (then a wall-clock span)
    assert [s.name for s in logged.spans] == ["momentum", "newton_schulz", "update"]
    assert logged.tallies() == direct.tallies() == {"communication": 0.75}
    logged.log = []  # a new step on the same clock
    assert logged.spans == [] and logged.tallies() == {}


# ---------------------------------------------------------------- the clock: wall clock on CPU, events on CUDA

import copy  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from muonlab import Muon  # noqa: E402
from muonlab.trace.spans import LANES, GpuMark  # noqa: E402


def test_cpu_tracer_marks_are_wall_clock_floats():
    for device in (None, "cpu", torch.device("cpu")):
        t = Tracer(rank=1, device=device)
        before = time.time()
        m = t.mark()
        assert isinstance(m, float) and before <= m <= time.time()
        with t.span("adamw") as s:
            pass
        assert before <= s.start <= s.end <= time.time()  # set at exit, as before marks existed
        t.tally("communication", 1.0, 1.5)
        t.tally("communication", 2.0, 2.25)
        t.resolve()  # nothing to do on CPU
        assert t.tallies() == {"communication": 0.75} and [x.name for x in t.spans] == ["adamw"]


class FakeCuda:
    """Stands in for torch.cuda's events on a CPU build: a fake GPU clock that moves 1 ms at
    every record, so a span's resolved duration counts the marks it covers, whatever the host did."""

    def __init__(self, monkeypatch):
        self.gpu_ms, self.syncs, self.created = 0.0, 0, 0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                fake.created += 1
                self.ms = None

            def record(self, stream=None):
                fake.gpu_ms += 1.0
                self.ms = fake.gpu_ms

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                assert self.ms is not None and end.ms is not None
                return end.ms - self.ms

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "synchronize", self._sync)

    def _sync(self, device=None):
        self.syncs += 1


def test_cuda_tracer_resolves_events_once_onto_the_host_clock(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    t = Tracer(rank=0, device="cuda:0")
    before = time.time()
    with t.span("momentum", batch=0) as s:
        time.sleep(0.02)  # host time that is no GPU time
    m1 = t.mark()
    m2 = t.mark()
    m3 = t.mark()
    t.add("comm_out", m1, m3, batch=0)
    t.tally("communication", m1, m2)
    t.tally("communication", m2, m3)
    assert isinstance(m1, GpuMark) and cuda.syncs == 0
    assert s.duration >= 0.02  # provisional: host (launch) times until resolved
    spans = t.spans  # resolves: one synchronisation
    after = time.time()
    assert cuda.syncs == 1
    assert spans[0].duration == pytest.approx(1e-3, abs=1e-6)  # one record apart on the GPU
    assert spans[1].duration == pytest.approx(2e-3, abs=1e-6)
    assert t.tallies() == {"communication": pytest.approx(2e-3, abs=1e-9)}
    # the anchor is read after the last event: every span ends before it, on the host axis
    assert spans[0].start < spans[0].end <= spans[1].start < spans[1].end <= after
    assert spans[0].start > before - 1.0
    t.spans, t.tallies(), t.resolve()
    assert cuda.syncs == 1  # resolved once
    created = cuda.created
    t.reset()
    with t.span("update"):
        pass
    t.reset()  # unread: dropped without a synchronisation, its events recorded again later
    t.add("comm_back", t.mark(), t.mark())
    assert cuda.syncs == 1 and cuda.created == created
    twin = copy.deepcopy(t)  # a copy holds resolved floats only
    assert cuda.syncs == 2 and [x.name for x in twin.spans] == ["comm_back"]
    assert twin.spans[0].duration == pytest.approx(1e-3, abs=1e-6) and cuda.syncs == 2


def test_muon_step_on_cuda_marks_does_not_synchronise_and_reads_phases_from_events(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(8, 16)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(4, 4))]
    bias = torch.nn.Parameter(torch.randn(16))
    opt = Muon([{"params": ws}, {"params": [bias], "algorithm": "adamw"}], nonfinite="ignore")
    monkeypatch.setattr(opt, "_trace_device", lambda: torch.device("cuda", 0))  # the work stays on CPU
    for p in ws + [bias]:
        p.grad = torch.randn_like(p)
    opt.step()
    assert cuda.syncs == 0  # recording spans never synchronises
    stats = opt.last_step_stats()
    assert cuda.syncs == 1
    spans = opt.last_step_spans()
    assert cuda.syncs == 1
    names = [s.name for s in spans]
    batches = len(opt.plan())
    assert names.count("newton_schulz") == names.count("momentum") == names.count("update") == batches == 2
    # every compute span is two consecutive records on the fake GPU clock: 1 ms, whatever the host did
    for s in spans:
        if LANES[s.name] == "compute":
            assert s.duration == pytest.approx(1e-3, abs=1e-6), s
    seconds = stats["seconds"]
    assert set(seconds) == {"momentum", "communication", "newton_schulz", "update", "adamw"}
    for phase, n in (("momentum", 2), ("newton_schulz", 2), ("update", 2), ("adamw", 1),
                     ("communication", 3 * 2)):  # local path: issue, wait, return, each one record apart
        assert seconds[phase] == pytest.approx(n * 1e-3, abs=1e-6), phase
    assert opt.last_step_stats()["seconds"] == seconds and cuda.syncs == 1
    for step in (2, 3):  # Muon alternates two tracers; from step 3 on, events are recorded again
        created = cuda.created
        for p in ws + [bias]:
            p.grad = torch.randn_like(p)
        opt.step()
        assert cuda.created == created or step == 2  # each mark still has an event of its own:
        assert opt.last_step_stats()["seconds"] == pytest.approx(seconds, abs=1e-6) and cuda.syncs == step
        assert all(s.duration == pytest.approx(1e-3, abs=1e-6) for s in opt.last_step_spans()
                   if LANES[s.name] == "compute")


def test_phase_seconds_on_cpu_are_the_spans_wall_clock_sums():
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(32, 64)) for _ in range(2)]
    opt = Muon(ws)
    for p in ws:
        p.grad = torch.randn_like(p)
    before = time.time()
    opt.step()
    after = time.time()
    spans, seconds = opt.last_step_spans(), opt.last_step_stats()["seconds"]
    assert all(before <= s.start <= s.end <= after for s in spans)
    for phase in ("momentum", "newton_schulz", "update", "adamw"):
        assert seconds[phase] == pytest.approx(sum(s.duration for s in spans if s.name == phase), abs=1e-12)
    assert 0.0 <= seconds["communication"] <= after - before
    assert sum(seconds.values()) <= after - before


def test_a_step_that_raises_leaves_the_last_steps_seconds_readable(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 16))
    opt = Muon([w], nonfinite="raise")
    monkeypatch.setattr(opt, "_trace_device", lambda: torch.device("cuda", 0))
    w.grad = torch.randn_like(w)
    opt.step()
    w.grad = torch.full_like(w, float("nan"))
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()  # raised after its tracer's reset; nothing was read in between
    assert cuda.syncs == 0
    seconds = opt.last_step_stats()["seconds"]  # the first step's, from its own events
    assert seconds["newton_schulz"] == pytest.approx(1e-3, abs=1e-6) and cuda.syncs == 1
    w.grad = torch.randn_like(w)
    opt.step()
    assert opt.last_step_stats()["seconds"]["momentum"] == pytest.approx(1e-3, abs=1e-6)
    twin = copy.deepcopy(opt)
    assert twin.last_step_stats()["seconds"] == opt.last_step_stats()["seconds"]


def test_spans_and_stats_describe_the_same_step_and_are_the_callers_copies():
    """After a step that raised, last_step_spans() was the failed step's (empty) list while the
    stats were the last good step's; and the stats' dicts were the optimizer's own."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 16))
    opt = Muon([w], nonfinite="raise")
    w.grad = torch.randn_like(w)
    opt.step()
    spans = [(s.name, s.start) for s in opt.last_step_spans()]
    assert any(name == "newton_schulz" for name, _ in spans)
    w.grad = torch.full_like(w, float("nan"))
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()
    assert [(s.name, s.start) for s in opt.last_step_spans()] == spans
    stats = opt.last_step_stats()
    seconds = dict(stats["seconds"])
    stats["seconds"]["newton_schulz"] = 1e9
    stats["bytes_sent"]["all_to_all"] = 123
    again = opt.last_step_stats()
    assert again["seconds"] == seconds and again["bytes_sent"] == {}


def test_chrome_trace_gives_communication_of_no_batch_a_thread_of_its_own():
    spans = [Span("comm_out", 0.0, 1.0, rank=0, path="owner", batch=-1),
             Span("comm_out", 0.5, 1.5, rank=0, path="owner", batch=0)]
    trace = to_chrome_trace(spans)
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["comm batch -1", "comm batch 0", "compute"]
    tids = [e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(set(tids)) == 2 and 1 not in tids
