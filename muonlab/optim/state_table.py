"""The optimizer's ``state`` as a table that counts its changes.

``Muon.state`` maps each parameter to its dict of state (momentum, moments, a rule's sums), as in
every torch optimizer. Looking a parameter up hashes a tensor, and ``Tensor.__hash__`` is a Python
function: one call per matrix per step, the last host work of a steady step that grows with the
matrices. This table counts (``version``) every change of which dict a parameter has: a dict set,
added (a missing parameter's, by the defaultdict too), removed or the table cleared. The step
program keeps each batch's dicts while the table and its version are the ones it read them from,
and looks them up again after any change. Changes inside a parameter's dict (a momentum buffer
dropped or replaced) need no count: the program reads the buffers from the dicts at every step.
"""

from __future__ import annotations

from collections import defaultdict


class StateTable(defaultdict):
    """A ``defaultdict(dict)`` whose ``version`` grows with every change of its items."""

    def __init__(self, items=()):
        super().__init__(dict, items)
        self.version = 0

    def __reduce__(self):  # pickles and copies as a table (items set one by one, each counted)
        return type(self), (), None, None, iter(self.items())

    def __setitem__(self, key, value):
        self.version += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.version += 1
        super().__delitem__(key)

    def pop(self, *args):
        self.version += 1
        return super().pop(*args)

    def popitem(self):
        self.version += 1
        return super().popitem()

    def setdefault(self, key, default=None):
        self.version += 1
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        self.version += 1
        super().update(*args, **kwargs)

    def __ior__(self, other):
        self.version += 1
        return super().__ior__(other)

    def clear(self):
        self.version += 1
        super().clear()
