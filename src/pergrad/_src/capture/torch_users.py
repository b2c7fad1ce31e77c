"""User-level squared norms from one captured pass: a user's examples play the role of one
example's positions.

User-level DP clips each user's summed gradient ``G_u = sum_{i in u} g_i``. For a linear map,
``g_i = sum_t a_it d_it^T``, so ``G_u`` is the per-example gradient of one "example" whose
positions are all the positions of the user's examples: the records of a user's examples laid
side by side along the position axis. Its squared norm therefore comes from the same certified
routes as a per-example norm (``torch_norms.outer_product_squared_norms``: Gram or formed, by
the cost model, with the rounding bound), run over regrouped records ``(U, M T, ...)``; a
table's from the rows the user's examples read. No per-example gradient of such a layer is
formed. Every other parameter (a bias, a norm layer's, a generic unit's, a tied weight's) has
its per-example gradients formed, one layer at a time, and summed per user.

The regrouping zero-pads each user to the size of its bucket (users grouped by their number of
examples rounded up to a power of two, so that the padding is at most the records' own size and
a batch with one large user does not pad every other to it); a zero row adds nothing to either
route. Padding (``mask``) joins no user.

The norms come back in the row layout of ``dp/users.user_slots``: row ``k`` holds the user whose
first real example in the batch is row ``k``; every other row is 0.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from pergrad._src.capture import cost, torch_quantities
from pergrad._src.capture.quantities import USER_SQUARED_NORMS, Lookups, Tokens
from pergrad._src.capture.rules import full_float32
from pergrad._src.capture.torch_norms import (
    certified_sum_of_squares,
    magnitudes,
    outer_product_squared_norms,
    unit_roundoff,
)
from pergrad._src.capture.torch_session import CapturedPass


class UserRows:
    """A batch's real examples grouped by user, for the per-user reductions below.

    Built from concrete ids (PyTorch runs eagerly): ``buckets`` holds, per bucket of users of
    similar size, ``(index (U_b, M_b), first (U_b,))``: each user's example rows (padded with
    ``B``, the row of zeros appended by :meth:`regroup`) and the row of its first real example.
    ``member`` is each real example's position in its user's flat list of examples (for the
    formed sums), ``user`` its user's number; both -1 for padding.
    """

    def __init__(self, user_ids: torch.Tensor, mask: Any) -> None:
        ids = user_ids.detach().cpu().numpy()
        real = np.ones(len(ids), bool) if mask is None else mask.detach().cpu().numpy() != 0
        self.batch_size = len(ids)
        self.device = user_ids.device
        members: dict[int, list[int]] = {}
        for row in np.flatnonzero(real):
            members.setdefault(int(ids[row]), []).append(int(row))
        groups = list(members.values())  # in the order of their first real example
        user = np.full(len(ids), -1, np.int64)
        for number, rows in enumerate(groups):
            user[rows] = number
        self.num_users = len(groups)
        self.user = torch.from_numpy(user).to(self.device)
        self.first = torch.tensor([rows[0] for rows in groups], dtype=torch.long, device="cpu")
        by_size: dict[int, list[int]] = {}
        for number, rows in enumerate(groups):
            by_size.setdefault(1 << (len(rows) - 1).bit_length(), []).append(number)
        self.buckets = []
        for size, numbers in sorted(by_size.items()):
            index = np.full((len(numbers), size), self.batch_size, np.int64)
            for slot, number in enumerate(numbers):
                index[slot, : len(groups[number])] = groups[number]
            first = self.first[numbers]
            self.buckets.append((torch.from_numpy(index).to(self.device), first.to(self.device)))

    def regroup(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``(B, T, ...)`` records -> ``(U_b, M_b T, ...)``: each user's examples' positions side
        by side, zero rows where the user has fewer than ``M_b`` examples."""
        padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
        grouped = padded[index]  # (U_b, M_b, T, ...)
        return grouped.reshape(index.shape[0], index.shape[1] * x.shape[1], *x.shape[2:])

    def in_rows(self, compute: Any, *records: torch.Tensor) -> Any:
        """``compute(*regrouped records) -> (U_b,)`` over every bucket, in the row layout:
        ``(B,)``, a certified pair where ``compute`` gives one."""
        estimates: list[torch.Tensor] = []
        bounds: list[Any] = []
        for index, _ in self.buckets:
            value = compute(*(self.regroup(x, index) for x in records))
            estimate, bound = cost.split(value)
            estimates.append(estimate)
            bounds.append(bound)
        like = records[0]
        dtype = estimates[0].dtype if estimates else _float_dtype(like)
        estimate = self._scatter([e.to(dtype) for e in estimates], like, dtype)
        if all(b is None for b in bounds) or not bounds:
            return estimate
        filled = [torch.zeros_like(e) if b is None else b for e, b in zip(estimates, bounds)]
        return cost.Certified(estimate, self._scatter([b.to(dtype) for b in filled], like, dtype))

    def _scatter(self, values: list[torch.Tensor], like: torch.Tensor, dtype: Any) -> Any:
        rows = like.new_zeros(self.batch_size, dtype=dtype)
        if not values:
            return rows
        firsts = torch.cat([first for _, first in self.buckets])
        return rows.index_copy(0, firsts, torch.cat(values))

    def tokens_norms(self, tokens: Tokens) -> Any:
        """Each user's squared norm of ``sum_{i in u} sum_t a_it d_it^T``, certified."""

        def norms(a: torch.Tensor, d: torch.Tensor) -> Any:
            return outer_product_squared_norms(a[:, None], d[:, None])

        return self.in_rows(norms, tokens.a, tokens.d)

    def lookups_norms(self, lookups: Lookups) -> Any:
        """Each user's squared norm of its table gradient: the output gradients of every
        position of its examples that reads one row add up; certified as ``nn.Embedding``'s
        rule is."""
        return self.in_rows(
            functools.partial(_table_norms, lookups.shape[0]), lookups.rows, lookups.d
        )

    def formed(self, grads: torch.Tensor) -> torch.Tensor:
        """``(B, *shape)`` per-example gradients -> ``(B,)`` squared norms of each user's sum,
        in the row layout. Padding adds nothing (a non-finite padded row included)."""
        flat = grads.reshape(self.batch_size, -1)
        real = self.user >= 0
        sums = flat.new_zeros(self.num_users, flat.shape[1])
        sums.index_add_(0, self.user[real], flat[real])
        rows = flat.new_zeros(self.batch_size)
        if self.num_users == 0:
            return rows
        return rows.index_copy(0, self.first.to(flat.device), (sums**2).sum(1))


def _table_norms(num_rows: int, rows: torch.Tensor, d: torch.Tensor) -> Any:
    """``(U,)`` squared norms of the table gradients of ``U`` regrouped users."""
    count, positions, width = d.shape
    user = torch.arange(count, device=rows.device).unsqueeze(1)
    keys = (user * num_rows + rows).reshape(-1)
    unique_keys, row_of_position = torch.unique(keys, return_inverse=True)
    row_sums = d.new_zeros(unique_keys.shape[0], width)
    row_sums.index_add_(0, row_of_position, d.reshape(-1, width))
    squared = d.new_zeros(count)
    squared.index_add_(0, unique_keys // num_rows, (row_sums**2).sum(1))
    if not cost.FAST_NORMS:
        return squared
    error = cost.gamma(positions, unit_roundoff(squared.dtype)) * magnitudes(d).sum(-1)
    return certified_sum_of_squares(squared, error, width + positions)


def _float_dtype(x: torch.Tensor) -> Any:
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()


@full_float32()  # TF32 off: the certified bounds assume float32's rounding
def user_squared_norms(session: CapturedPass, users: UserRows) -> Any:
    """Each differentiated leaf's ``(B,)`` squared norms of the users' summed gradients, in the
    row layout (``torch_quantities.LeafSquaredNorms``, with the routes' rounding bounds): from
    the regrouped records where the layer gives tokens or lookups, from the per-example
    gradients (formed a layer at a time) summed per user elsewhere."""
    values = torch_quantities.plug_in_values(session, USER_SQUARED_NORMS.name, (users,))
    estimates, bounds = [], []
    with torch.no_grad():
        for value, reduced in values:
            found = value if reduced else users.formed(value)
            estimate, bound = cost.split(found)
            estimates.append(estimate)
            bounds.append(bound)
    return torch_quantities.LeafSquaredNorms(estimates, bounds)
