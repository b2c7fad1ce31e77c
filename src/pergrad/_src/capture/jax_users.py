"""User-level squared norms from one batched JAX pass, with static shapes (under ``jax.jit``,
traced user ids): the JAX half of ``torch_users.py``.

Each example carries its user's *row*, the batch index of the user's first real example (the
row layout of ``dp/users.user_slots``; padding gets row ``B``, which every ``segment_sum`` here
drops). A user's summed gradient of a linear map is ``sum_{i in u} sum_t a_it d_it^T``:

- where the ``B x K x F`` per-example gradients stay under ``cost.MAX_FORMED_NUMBERS``, each
  example's is formed (one batched product, this layer only) and summed into its user's row;
- else, the Gram route over the batch's ``P = B T`` positions: ``sum_{p, q of one user}
  (a_p . a_q)(d_p . d_q)``, the pairs of different users masked out (``P x P``, no
  per-example gradient formed).

Both with the rounding bound of ``jax_contractions._formed`` / ``_gram``, over each user's
positions. A table's: the cotangents of the positions of one user that read one row summed
(sorted by (user, row), as ``jax_contractions._row_sums_squared`` does per example), then
squared, certified as a sum of squares. Everything else (biases, tied tables, leaves without a
site) has its per-example gradients formed in the pass anyway: summed per user (:meth:`formed`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pergrad._src.capture import cost
from pergrad._src.capture.jax_contractions import (
    certified_gram,
    certified_sum_of_squares,
    unit_roundoff,
)
from pergrad._src.capture.quantities import Lookups, Tokens

_EXACT = jax.lax.Precision.HIGHEST


class UserGroups(NamedTuple):
    """``row``: ``(B,)`` each example's user row (``B`` for padding)."""

    row: Any

    @classmethod
    def from_slots(cls, slots: Any) -> UserGroups:
        """From ``dp/users.user_slots``'s ``(B, B)`` grouping: ``slots[k, i] = 1`` where
        example ``i`` belongs to the user of row ``k``."""
        batch = slots.shape[0]
        member = slots.sum(axis=0) > 0
        return cls(jnp.where(member, jnp.argmax(slots, axis=0), batch))

    def formed(self, grads: Any) -> Any:
        """``(B, *shape)`` per-example gradients -> ``(B,)`` squared norms of each user's sum."""
        batch = grads.shape[0]
        flat = grads.reshape(batch, -1)
        sums = jax.ops.segment_sum(flat, self.row, num_segments=batch)
        return (sums**2).sum(axis=1)

    def tokens_norms(self, tokens: Tokens) -> Any:
        a, d = tokens.a, tokens.d
        batch, positions, k = a.shape
        f = d.shape[2]
        if batch * k * f <= cost.MAX_FORMED_NUMBERS:
            return self._formed(a, d)
        return self._gram(a, d)

    def _formed(self, a: Any, d: Any) -> cost.Certified:
        batch, positions, k = a.shape
        f = d.shape[2]
        unit = unit_roundoff(a.dtype)
        formed = jnp.einsum("btk,btf->bkf", a, d, precision=_EXACT)
        summed = jax.ops.segment_sum(formed, self.row, num_segments=batch)
        squared = jax.lax.optimization_barrier((summed**2).sum(axis=2)).sum(axis=1)
        terms = (jnp.linalg.norm(a, axis=2) * jnp.linalg.norm(d, axis=2)).sum(axis=1)
        user_terms = jax.ops.segment_sum(terms, self.row, num_segments=batch)
        # each entry: T products summed per example, then at most B examples per user
        error = cost.product_error(positions + batch, unit) * user_terms
        return certified_sum_of_squares(squared, error, k + f + positions + batch, unit)

    def _gram(self, a: Any, d: Any) -> cost.Certified:
        batch, positions, k = a.shape
        f = d.shape[2]
        count = batch * positions
        flat_a, flat_d = a.reshape(count, k), d.reshape(count, f)
        user = jnp.repeat(self.row, positions)
        same = (user[:, None] == user[None, :]) & (user[:, None] < batch)
        norms = jnp.linalg.norm(flat_a, axis=1), jnp.linalg.norm(flat_d, axis=1)
        gram_a = jnp.einsum("pk,qk->pq", flat_a, flat_a, precision=_EXACT)
        gram_d = jnp.einsum("pf,qf->pq", flat_d, flat_d, precision=_EXACT)

        def per_user(x: Any) -> Any:  # only the pairs of one user's positions
            rows = jax.lax.optimization_barrier(jnp.where(same, x, 0).sum(axis=1))
            return jax.ops.segment_sum(rows, user, num_segments=batch)

        terms = jax.ops.segment_sum(norms[0] * norms[1], user, num_segments=batch)
        return certified_gram((gram_a, gram_d), norms, terms, (k, f), count, per_user)

    def lookups_norms(self, lookups: Lookups) -> cost.Certified:
        rows, d = lookups.rows, lookups.d
        batch, positions = rows.shape
        width = d.shape[-1]
        count = batch * positions
        owner_of = jnp.repeat(self.row, positions)
        flat = rows.reshape(-1)
        order = jnp.lexsort((flat, owner_of))
        flat, owner_sorted = flat[order], owner_of[order]
        starts = jnp.concatenate(
            [jnp.ones(1, bool), (flat[1:] != flat[:-1]) | (owner_sorted[1:] != owner_sorted[:-1])]
        )
        segment = jnp.cumsum(starts) - 1
        owner = jnp.full(count, batch, owner_sorted.dtype).at[segment].set(owner_sorted)
        sums = jax.ops.segment_sum(d.reshape(count, width)[order], segment, num_segments=count)
        squared = jax.ops.segment_sum((sums**2).sum(axis=1), owner, num_segments=batch)
        unit = unit_roundoff(d.dtype)
        magnitude = jax.ops.segment_sum(
            jnp.linalg.norm(d.reshape(count, width), axis=1), owner_of, num_segments=batch
        )
        error = cost.gamma(count, unit) * magnitude
        return certified_sum_of_squares(squared, error, width + count, unit)
