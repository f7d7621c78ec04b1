"""Per-rank spans and byte counters of optimizer steps, and their export."""

from .spans import Span, Tracer, gather_spans, to_chrome_trace, write_chrome_trace

__all__ = ["Span", "Tracer", "gather_spans", "to_chrome_trace", "write_chrome_trace"]
