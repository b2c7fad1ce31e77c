"""Strategies: the ways pergrad computes per-example quantities, one module each.

Per-example gradients (:func:`pergrad.per_example_grads`, ``strategy=``):

- ``vmap.py`` (``"vmap"``): the framework's ``vmap(value_and_grad(loss of one example))``.
- ``hooks_torch.py`` (``"hooks"``, PyTorch ``module_loss``): one batched pass with layer hooks
  (``capture/``), per-example gradients from the layer rules, checked; what it must watch is
  planned in ``hooks_plan.py``.
- ``loop.py`` (``"loop"``): one example at a time with plain autodiff.

Per-example norms and clipped sums (:func:`pergrad.norms.per_example_norms_of`,
:func:`pergrad.dp.clipped_sum_of`, ``strategy=``), each returning a ``Reduction``:

- ``ghost_torch.py`` (``"ghost"``, PyTorch ``module_loss``): norms and weighted sums from the
  captured layer inputs and output gradients, without forming per-example gradients; and
  (``"ghost-lowmem"``) the same with each layer's records dropped in its hook, the weighted
  sums from a second backward pass. A thin schedule over the PyTorch capture kernel
  (``capture/torch_plan.py``, ``torch_session.py``, ``torch_passes.py``,
  ``torch_quantities.py``, ``torch_verify.py``).
- ``ghost_jax.py`` (``"ghost"``, any JAX loss): the same from the contractions of the traced
  loss of one example.
- ``chunked.py`` (``"chunked"``, both frameworks): per-example gradients a chunk at a time,
  reduced at once; the clipped sum as one weighted batch gradient.
- ``materialize.py`` (``"materialize"``): :func:`pergrad.per_example_grads`, which the entry
  points of ``api/reductions.py`` reduce.

Every strategy module has an ``assess`` and a ``run`` and receives the analysed call
(``core/call.py``: ``Spec``, ``Call``, ``single_example_fn``). ``registry.py`` holds them in one
table (the framework strategies reached through small dispatchers that import torch or JAX only
for a call that can be theirs): each one's ``assess`` (can it
take this call, before running anything, and why not) and ``run`` (which raises
``Unsupported`` on finding out only while running), the order ``strategy="auto"`` tries them
in, and the one fallback discipline of every task. ``protocol.py`` holds the types they share
(``Assessment``, ``StrategyChoice``, ``Reduction``, the requests). ``api/grads.py`` and ``api/reductions.py``
only build a request and call the registry.
"""
