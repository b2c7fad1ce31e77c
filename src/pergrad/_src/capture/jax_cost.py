"""The cost model's view of a traced JAX loss: each ghost site as a :class:`cost.LayerWork`, and
the extra work of the ghost norms against materialising the per-example gradients
(``strategies/ghost_jax.py`` asks it under ``strategy="auto"``).

The work of each route is the PyTorch model's (``cost.route_costs``: the ghost norms per site by
the route ``jax_contractions.norm_route`` takes, against ``cost.MATERIALIZED_NUMBER_COST``
multiply-adds per per-example number), without the fixed cost per layer, which is PyTorch's
Python per layer: under ``jit`` there is none. A clipped sum's leaves that the ghost step holds
as their formed per-example gradients (``ghost_jax._held``: no more numbers than their
cotangents) cost what the PyTorch model's held layers cost (``cost.held_norm_work``). Memory is
not the PyTorch model's: XLA forms a dense layer's per-example gradients inside the backward
pass and can sum them without keeping them (the clipped sum rewritten as one product over the
examples), but not those of a row lookup (a scatter). So the memory half of the choice asks
XLA itself (``ReduceRequest.compiled_bytes``: each route's compiled temporary memory).
"""

from __future__ import annotations

import math

from pergrad._src.capture import cost
from pergrad._src.capture.jax_contractions import dense_factor_shape
from pergrad._src.capture.jax_engine import JaxGhostPlan, Site
from pergrad._src.capture.jax_rules import rule_for


def site_work(site: Site, numbers: int) -> cost.LayerWork:
    """One site's shape as the cost model sees it; ``numbers``: its parameter's size."""
    output = site.eqn.outvars[0].aval
    out_numbers = math.prod(output.shape)
    if site.family == "embedding":
        return cost.LayerWork("light", 1, (out_numbers,), 1, numbers)
    shape = dense_factor_shape(site)
    if shape is None:  # a convolution: its per-example gradient formed over its positions
        param_shape = site.eqn.invars[site.param_operand].aval.shape
        widest = max(param_shape, default=1)
        positions = max(1, out_numbers // widest)
        return cost.LayerWork("formed", positions, (), 1, numbers)
    positions, width_in, width_out = shape
    return cost.LayerWork("dense", positions, (width_in, width_out), 1, numbers)


def _output_numbers(site: Site) -> int:
    return math.prod(site.eqn.outvars[0].aval.shape)


def _held(works: list[cost.LayerWork], numbers: int) -> cost.LayerWork:
    first = works[0]
    return first._replace(kind="held", norm_work=cost.held_norm_work(works), numbers=numbers)


def route_costs(
    found: JaxGhostPlan, batch_size: int, sizes: list[int], clipped: bool
) -> cost.RouteCosts:
    """``cost.route_costs`` of this plan's sites for ``batch_size`` examples; ``sizes``: every
    differentiated leaf's size, in the core's flat order (their sum is ``P``); ``clipped``: for
    a clipped sum, whose ghost step holds some leaves as their formed per-example gradients
    (read as ``ghost_jax._held`` reads it)."""
    hold = clipped and cost.HOLD_FORMED and cost.FAST_NORMS
    works = []
    for k, site in found.sites.items():
        work = site_work(site, sizes[k])
        if hold and rule_for(site).held and sizes[k] <= _output_numbers(site):
            work = _held([work], sizes[k])
        works.append(work)
    for k, group in found.shared.items():
        uses = [site_work(site, sizes[k]) for site in group]
        if hold and sizes[k] <= sum(_output_numbers(site) for site in group):
            uses = [_held(uses, sizes[k])]
        works += uses
    return cost.route_costs(batch_size, sum(sizes), works, layer_cost=0.0, fast_gram=False)
