"""The core: a call analysed once (``call.py``: backend, in_axes, batch size; ``axes.py``:
in_axes inference) and the loss of one example from a PyTorch module (``module_loss.py``):
what every strategy, capture engine and entry point above receives."""
