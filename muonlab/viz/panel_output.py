"""How a widget panel shows a figure: as its Output widget's only output, drawn once, here.

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
