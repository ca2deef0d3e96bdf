"""Showing a figure in an ipywidgets ``Output`` from a widget callback.

``show_in(out, "note", fig)`` replaces what ``out`` shows. It sets the
widget's outputs from the kernel side rather than capturing ``display()``
calls inside ``with out:``. The result in JupyterLab is the same; the
difference is for headless runs (nbclient, behind ``make figures``), whose
stand-in for the browser's Output widget answers every captured display
with messages back to the kernel. Executions with those captures stalled
now and then (for minutes) on our machines; with ``show_in`` there is
nothing to answer.
"""

from __future__ import annotations


def show_in(output, *objects) -> None:
    """Make ``output`` (an ``ipywidgets.Output``) show ``objects``: strings as text, the
    rest (a plotly figure, ...) as rich display data."""
    output.outputs = ()
    for obj in objects:
        if isinstance(obj, str):
            output.append_stdout(obj if obj.endswith("\n") else obj + "\n")
        elif hasattr(obj, "_repr_mimebundle_"):  # plotly figures: what display() would send
            bundle = obj._repr_mimebundle_(include=None, exclude=None)
            output.outputs += ({"output_type": "display_data", "data": bundle,
                                "metadata": {}},)
        else:
            output.append_display_data(obj)
