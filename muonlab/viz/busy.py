"""Panel buttons that say when the kernel is busy running cells.

A click on a panel is a message to the kernel, which handles messages in order: after a "Run All"
it reaches the kernel only once every queued cell has run, so a click during a long run waited
minutes with nothing on the page saying so. Here, while a cell runs, every live panel button is
disabled and says why (its text and its tooltip, drawn by the frontend at once); after the cell it
is as it was. A click in the instant between two cells still waits its turn and then runs.

IPython's ``pre_run_cell`` / ``post_run_cell`` events drive it; outside IPython (a script, a test
calling ``update()``) nothing is registered and the buttons never change.
"""

from __future__ import annotations

import weakref

BUSY_SUFFIX = " (kernel busy)"
BUSY_TOOLTIP = "The kernel is running cells: this button takes clicks again when they finish."

_buttons: weakref.WeakSet = weakref.WeakSet()
_saved: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # button -> (description, tooltip, disabled)


def say_when_busy(*buttons) -> None:
    """Disable ``buttons`` (ipywidgets ``Button``s) with a busy message while the kernel runs a
    cell, from the next cell on. A button is held weakly: a closed panel is forgotten."""
    shell = _shell()
    if shell is None:
        return
    if _busy not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _busy)
        shell.events.register("post_run_cell", _idle)
    _buttons.update(buttons)


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _busy(*_info) -> None:
    for button in list(_buttons):
        if button in _saved:
            continue
        _saved[button] = (button.description, button.tooltip, button.disabled)
        # one message to the frontend for the three: sent apart, the page showed the busy text
        # with the button still enabled for a moment (a fresh clone's browser test clicked then)
        with button.hold_sync():
            button.disabled = True
            button.description = button.description + BUSY_SUFFIX
            button.tooltip = BUSY_TOOLTIP


def _idle(*_result) -> None:
    for button in list(_saved):
        description, tooltip, disabled = _saved.pop(button)
        with button.hold_sync():
            button.description, button.tooltip, button.disabled = description, tooltip, disabled
