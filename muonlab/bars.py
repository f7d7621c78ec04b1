"""Notebook progress bars that read right once the notebook is saved, and the test for a notebook.

A tqdm notebook bar is a widget; a viewer without the widget's state (GitHub, nbviewer, JupyterLab
before the kernel runs) shows the text the bar had when it was first displayed: "0%". The bars
here are displayed with a text fallback that says what the bar was, and callers leave a plain
summary line when the work ends.
"""

from __future__ import annotations

import sys


def in_notebook_kernel() -> bool:
    """True inside a Jupyter kernel (an IPython shell with a kernel attached)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def notebook_bar(desc: str, total: int | None, *, unit: str = "step", handle=None):
    """A ``tqdm.notebook`` bar, displayed (through the IPython ``DisplayHandle`` ``handle`` if
    given) with a text fallback naming it instead of its first drawing."""
    from IPython.display import display
    from tqdm.notebook import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, display=False)
    size = f"{total} {unit}s" if total is not None else f"{unit}s"
    bundle = dict(bar.container._repr_mimebundle_())
    bundle["text/plain"] = f"{desc}: progress bar over {size} (live while the cell runs)"
    if handle is None:
        display(bundle, raw=True)
    else:
        handle.display(bundle, raw=True)
    return bar
