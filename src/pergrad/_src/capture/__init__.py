"""Capture: one batched pass that records, for each parameterised layer, its inputs and output
gradients, and the per-layer rules that reduce those records per example.

- ``rules.py``: the layer-rule registry (:func:`rule_for`, :func:`register`).
- ``torch_layers.py``: the rules for PyTorch's standard layers (Linear, convolutions,
  Embedding, norm layers, Hugging Face Conv1D).
- ``torch_engine.py``: the forward / tensor hooks that record each layer call over one pass,
  and the per-example losses of a ``module_loss`` output.
- ``torch_generic.py``: layers without a rule, run alone with ``torch.func``.
- ``torch_checks.py``: what the first call of each layout establishes (where the batch is).

The JAX counterpart (contraction interception in a traced jaxpr) lives with its strategy in
``strategies/ghost_jax.py``.
"""
