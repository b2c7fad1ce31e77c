"""The core: a call analysed once (``call.py``: backend, in_axes, batch size; ``axes.py``:
in_axes inference), the public entry points for per-example gradients (``api.py``) and for
per-example norms and clipped sums (``reductions.py``), which hand the analysed call to a
strategy (``strategies/``)."""
