"""How a widget panel shows a figure: as its Output widget's only output, drawn once, here. And how
it checks a starting value against its control, before building it (see ``check_range``).

Setting the Output's outputs (instead of ``with output: display(fig)``) needs no frontend, so a
panel updated where none is attached (nbval, a script) shows nothing under the cell; closing the
figure keeps the inline backend from drawing it a second time there.
"""

from __future__ import annotations

import base64
import io

import matplotlib.pyplot as plt


def show_figure(output, fig, label: str = "figure") -> None:
    """Make ``fig`` the one output of the ipywidgets Output ``output``, then close it; ``label`` is
    the text a viewer without images shows."""
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=fig.dpi)
        output.outputs = ({"output_type": "display_data", "metadata": {},
                           "data": {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                                    "text/plain": label}},)
    finally:
        plt.close(fig)


def check_range(name: str, value, lo, hi, *, integer: bool = False, what: str = "its slider's range") -> None:
    """A ValueError naming ``name`` unless lo <= ``value`` <= hi (and ``value`` is an int, if
    ``integer``). A slider clamps a value outside its range and a dropdown refuses one outside its
    options with a TraitError naming neither: a panel checks its starting values here first, before
    any widget exists."""
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name}={value!r} is outside {what}: expected {kind} in [{lo}, {hi}]")


def check_choice(name: str, value, choices) -> None:
    """A ValueError naming ``name`` and the choices unless ``value`` is one of them (see ``check_range``)."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of the panel's choices {list(choices)}")
