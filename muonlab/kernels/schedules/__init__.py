"""The Newton-Schulz coefficient schedules: one module each, and ``SCHEDULES``, the only registry.

``NSConfig(coefficients=name)`` (Muon's ``ns_coefficients``) takes any name here; the order here
is the order listings use. A new schedule is one module with a ``SCHEDULE`` and one entry below.
"""

from . import cans, keller, polar_express, polar_express_paper, xtuner
from .base import Schedule, Triple

SCHEDULES: dict[str, Schedule] = {m.SCHEDULE.name: m.SCHEDULE for m in (
    keller, xtuner, polar_express, polar_express_paper, cans)}

__all__ = ["SCHEDULES", "Schedule", "Triple"]
