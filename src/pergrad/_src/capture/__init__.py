"""Capture: one batched pass that records, for each parameterised layer, its inputs and output
gradients, and the per-layer rules that reduce those records per example.

- ``rules.py``: the layer-rule registry (:func:`rule_for`, :func:`register`, and
  :func:`register_reduction` for plug-in reductions).
- ``torch_layers.py``: the rules for PyTorch's dense layers (Linear, convolutions, Embedding,
  Hugging Face Conv1D) and the maths other rule files share.
- ``torch_attention.py``: the rule of ``nn.MultiheadAttention`` (its attention recomputed from
  the recorded call; its projections reduced as linear layers).
- ``torch_rules/``: one file per newer layer family (``norms.py``, ``bilinear.py``); importing the package
  registers every rule (the two files above included), so a new family is one file.
- ``torch_engine.py``: the forward / tensor hooks that record each layer call over one pass,
  and the per-example losses of a ``module_loss`` output.
- ``torch_generic.py``: layers without a rule, run alone with ``torch.func``.
- ``torch_checks.py``: what the first call of each layout establishes (where the batch is).
- ``torch_plan.py``: the ownership planner (which layer, generic unit or position-bias table
  reduces each differentiated parameter; ``plan`` before running, ``Ownership`` for one call).
- ``torch_session.py``: one captured pass and its state (``forward``, ``CapturedPass``), and
  the arming of the records for reductions in the backward pass's hooks (``when_complete``).
- ``torch_passes.py``: the backward passes over a captured pass, in the order the checks need
  (``capture``; the low-memory mode's ``second_pass``).
- ``torch_held.py``: the one-pass DP step's layers held as their formed per-example gradients
  where those are smaller than their output gradients (reduced in the backward pass's hooks).
- ``torch_held_tied.py``: the same for a tied parameter (GPT-2's token table and LM head): its
  uses' terms summed into one held per-example gradient as each use completes.
- ``torch_quantities.py``: the per-layer reductions over a pass's records (squared norms, tied
  norms, formed per-example gradients, weighted sums, plug-in reductions).
- ``torch_verify.py``: the first call's verification of a captured pass (row-local output
  gradients, losses run alone, the batch gradient against the norms).
- ``torch_tied.py``: a parameter two layers share (tied weights): the cross rules that give the
  inner product of the two layers' per-example gradients from their records.

- ``jax_engine.py``: the JAX counterpart: the loss of one example traced to a jaxpr, each
  differentiated leaf's contraction found in it, and ``records``: one batched pass that keeps
  each contraction's input and exposes its output cotangent.
- ``jax_rules.py``: the contraction-rule registry by kind (``rule_for``, ``register``,
  ``register_reduction``); ``jax_contractions.py``: the rules (squared norms, per-example
  gradients, weighted sums of dense, convolution and embedding contractions).
"""
