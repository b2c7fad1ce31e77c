"""Influence and data attribution: scores (dot, cosine, influence functions, TracIn, TRAK),
inverse-Hessian-vector products, random projections, streaming over a dataset.

Solvers and estimators are registered classes (``protocol.py``). Importing the package imports
the modules that define the built-in ones, so that every name is registered whichever module
is imported first, and in this order (the order error messages list them in).
"""

from pergrad._src.influence import (  # noqa: F401  (imported to register their classes)
    ihvp,
    influence_function,
    kfac,
    metagradient,
    similarity,
    tracin,
    trak,
)
