"""Influence and data attribution: scores (dot, cosine, influence functions, TracIn), inverse-Hessian-vector products, random projections, streaming over a dataset."""
