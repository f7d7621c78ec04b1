"""Panel buttons while the kernel runs cells (muonlab.viz.busy), in a real IPython shell: disabled
with a message during a cell, as they were after it, a failing cell included."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from muonlab.viz.busy import BUSY_TOOLTIP, say_when_busy  # noqa: E402


@pytest.fixture
def shell():
    shell = InteractiveShell.instance()
    try:
        yield shell
    finally:
        InteractiveShell.clear_instance()  # get_ipython() is None again for the tests after


def _state(button):
    return button.disabled, button.description, button.tooltip


def test_a_panel_button_says_the_kernel_is_busy_while_a_cell_runs(shell):
    import ipywidgets as w

    train, off = w.Button(description="train"), w.Button(description="clear", disabled=True)
    say_when_busy(train, off)
    say_when_busy(train)  # twice: one registration, one message
    shell.user_ns.update(train=train, off=off)
    shell.run_cell("during = (train.disabled, train.description, train.tooltip, off.disabled)")
    assert shell.user_ns["during"] == (True, "train (kernel busy)", BUSY_TOOLTIP, True)
    assert _state(train) == (False, "train", None) and _state(off) == (True, "clear", None)
    shell.run_cell("raise ValueError('a failing cell')")
    assert _state(train) == (False, "train", None)


def test_outside_ipython_buttons_never_change():
    import ipywidgets as w

    assert InteractiveShell.initialized() is False
    button = w.Button(description="run")
    say_when_busy(button)
    assert _state(button) == (False, "run", None)


def test_the_busy_state_reaches_the_frontend_in_one_message_each_way(shell, monkeypatch):
    """Disabled, text and tooltip in one state update: sent one by one, the page showed the busy
    text on a button still enabled for a moment, and a click then went through."""
    import ipywidgets as w

    train = w.Button(description="train")
    sent = []
    monkeypatch.setattr(train, "send_state", lambda key=None: sent.append(sorted(key) if key else key))
    say_when_busy(train)
    shell.run_cell("pass")
    assert sent == [["description", "disabled", "tooltip"]] * 2, sent
