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
