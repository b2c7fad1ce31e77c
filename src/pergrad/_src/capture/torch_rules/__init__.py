"""PyTorch layer families, one rule file each: importing this package registers every rule.

A new family is one file here: its functions decorated with
:func:`pergrad._src.capture.rules.register` (Opacus's ``grad_sample`` layout). Every module of
this package is imported when the capture engine is, so nothing else names the new file; its
tests are one case in the ghost zoo (``tests/test_ghost.py``'s ``GHOST_ZOO``), which checks the
norms, the clipped sums and the hooks' per-example gradients against a loop.

The families written before this package (``capture/torch_layers.py``: Linear, convolutions,
Embedding, norm layers, Hugging Face Conv1D and RMS norms; ``capture/torch_attention.py``:
``nn.MultiheadAttention``) are imported here too.
"""

from __future__ import annotations

import importlib
import pkgutil

from pergrad._src.capture import torch_attention, torch_layers  # noqa: F401  (register)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
