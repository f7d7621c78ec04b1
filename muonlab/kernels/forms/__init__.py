"""The Newton-Schulz forms: one module each, and ``FORMS``, the only registry of them.

The dispatcher runs ``FORMS[name].iterate``, the workspace reads ``squares``, the FLOP model
``flops``, the "auto" timing ``key``; the order here is the order of ``NSConfig``'s choices.
A new form is one module with a ``FORM`` and one entry below.
"""

from . import gram, plain
from .base import NSForm

FORMS: dict[str, NSForm] = {m.FORM.name: m.FORM for m in (plain, gram)}

PLAIN = "plain"
"""The form every other falls back to (square matrices, and shapes where one saves too little)."""

__all__ = ["FORMS", "PLAIN", "NSForm"]
