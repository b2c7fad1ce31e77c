"""Influence and data attribution: which training examples help or hurt which test examples.

    scores = pergrad.influence.influence_function(
        loss, params, (X_train, Y_train), (X_test, Y_test), damping=1e-3, solver="cg")
    scores.shape   # (n_train, n_test); positive: train example i helps test example j

``loss`` is the loss of ONE example, as for :func:`pergrad.per_example_grads`. Every score has
the same sign convention: positive means the training example lowers the test example's loss.
For influence functions, removing training example ``i`` changes test example ``j``'s loss by
about ``+scores[i, j] / n_train``.

For large models, :func:`project` maps per-example gradients to a small dimension first
(seeded random projection, the same in both frameworks); :func:`grad_dot` and
:func:`grad_cosine` take the projected ``(n, k)`` arrays as they are. :func:`top_k` streams over a training set
given as batches and keeps each test example's top-k proponents and opponents. For a training
set that does not fit in memory, :class:`TRAK` streams TRAK features to disk once and scores any
later targets against them.

A training set split over processes or devices: score each shard with ``top_k(..., offset=)``
(or :func:`top_k_from_scores` on scores of projected gradients), then :func:`merge_top_k` the
shards' results (or :func:`all_gather_top_k` over ``torch.distributed``); the merged result
equals the single-process one, ties included.

Why did THIS trained model do that? :func:`metagradient` differentiates targets exactly through
a deterministic replay of the training run (the MAGIC regime): ``d target / d w_i`` for each
example's weight, SGD / momentum / Adam(W) (:func:`sgd`, :func:`adam`) or any optax
transformation, on both frameworks; :func:`replay` is the same run with example weights, for
checking the scores by retraining with the same initialisation and order, and
:func:`linearity_check` says, from a few such replays, how far the run is from its
linearisation (when to trust the scores).

To measure how good a method's scores are, retrain on random half-size subsets
(:func:`lds_subsets`) and compute the linear datamodeling score, :func:`lds`.

Solvers (``solver=``) and estimators (``top_k``'s ``method=``) are registered classes: a name
(``"cg"``, ``"dot"``) stands for the class with its default options. A new one subclasses
:class:`Solver` or :class:`Estimator` with ``name=`` and implements two methods (a solver:
``prepare`` and ``solve``) or one (an estimator: ``prepare``, or ``scores`` if it needs the
whole training set at once); every function that takes one then takes it by that name.
"""

from pergrad._src.influence.ihvp import CG, Exact, InfluenceWarning, LiSSA
from pergrad._src.influence.kfac import EKFAC, KFAC
from pergrad._src.influence.kronecker import project_factored
from pergrad._src.influence.lds import lds, lds_subsets
from pergrad._src.influence.metagradient import Metagradient, adam, metagradient, replay, sgd
from pergrad._src.influence.metagradient_check import LinearityCheck, linearity_check
from pergrad._src.influence.outputs import classification_margin, classification_weight
from pergrad._src.influence.projection import project
from pergrad._src.influence.protocol import Estimator, Solver, Task
from pergrad._src.influence.scores import (
    grad_cosine,
    grad_dot,
    influence_function,
    inverse_hvp,
    self_influence,
    tracin,
    trak,
)
from pergrad._src.influence.streaming import (
    TopK,
    all_gather_top_k,
    merge_top_k,
    top_k,
    top_k_from_scores,
)
from pergrad._src.influence.trak_store import TRAK

__all__ = [
    "CG",
    "EKFAC",
    "Estimator",
    "Exact",
    "InfluenceWarning",
    "KFAC",
    "LiSSA",
    "LinearityCheck",
    "Metagradient",
    "Solver",
    "TRAK",
    "Task",
    "TopK",
    "adam",
    "all_gather_top_k",
    "classification_margin",
    "classification_weight",
    "grad_cosine",
    "grad_dot",
    "influence_function",
    "inverse_hvp",
    "lds",
    "lds_subsets",
    "linearity_check",
    "merge_top_k",
    "metagradient",
    "project",
    "project_factored",
    "replay",
    "self_influence",
    "sgd",
    "top_k",
    "top_k_from_scores",
    "tracin",
    "trak",
]
