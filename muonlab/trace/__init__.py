"""Per-rank spans and byte counters of optimizer steps, their export, and spectral records of training."""

from .spans import Span, Tracer, gather_spans, to_chrome_trace, write_chrome_trace
from .step_time import exposed_comm_table, format_table, phase_table
from .steps import StepRecorder
from .whole_step import WholeStepRecorder
from .spectral import (DERIVED, METRICS, SpectralRecord, SpectralRecorder, exact_ortho_error,
                       exact_top_singular_value, gather_spectral, ortho_error_from_gram, records_by_name,
                       sampled_ortho_error, top_singular_values)

__all__ = [
    "DERIVED", "METRICS", "Span", "SpectralRecord", "SpectralRecorder", "Tracer", "exact_ortho_error",
    "exact_top_singular_value", "gather_spans", "gather_spectral", "ortho_error_from_gram", "records_by_name",
    "StepRecorder", "exposed_comm_table", "format_table", "phase_table",
    "sampled_ortho_error", "to_chrome_trace", "top_singular_values", "write_chrome_trace", "WholeStepRecorder",
]
