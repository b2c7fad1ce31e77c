"""TRAK at dataset scale: training features streamed to disk once, any targets scored later.

:class:`TRAK` makes the same scores as :func:`pergrad.influence.trak` (same features, kernel
and weighting, from ``trak.py``), split in two steps as ``traker`` does:

- ``featurize(batches)`` reads the training set once, as an iterable of batches of any sizes,
  and appends each model's projected features ``Phi_m`` and weights ``Q_m`` to raw float32
  files under ``path`` (read back as ``np.memmap``), while accumulating ``Phi_m^T Phi_m`` in
  float64: the kernel needs no second pass over the features;
- ``score(targets)`` / ``top_k(targets)`` compute the targets' features, solve
  ``(Phi_m^T Phi_m + damping I)^-1 phi_m^T`` (one eigendecomposition per model, kept for the
  next call) and stream over the stored rows in chunks.

The folder holds ``trak.json`` (what made the features: framework, options, one fingerprint per
checkpoint), ``state.npz`` (the examples written so far, whether the stream ended, the Gram
matrices; replaced atomically, so it always describes whole batches) and, per model ``m``,
``features_m.f32`` ``(n, D)`` and ``weights_m.f32`` ``(n,)``. Rows a killed process wrote
after the last saved state are cut off when the store is resumed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.influence.flat_loss import check_batch, check_fn, slice_batch
from pergrad._src.influence.ihvp import as_backend_array
from pergrad._src.influence.streaming import TopK, merge_top_k, top_k_from_scores, with_progress
from pergrad._src.influence.trak import (
    MAX_MATRIX_NUMBERS,
    ModelFeaturizer,
    check_checkpoints,
    check_dampings,
    eigh_psd,
    solve_eigh,
)
from pergrad._src.influence.trak_files import (
    DISK_DTYPE,
    FORMAT,
    META,
    SAVE_SECONDS,
    atomic_write,
    fingerprint,
    memmap,
    read_meta,
    read_state,
    resolve_options,
    store_file,
    to_disk,
    truncate,
    write_state,
)

# Stored rows scored at once by default: rows * D <= this (float64: 32 MB per model).
DEFAULT_ROW_NUMBERS = 2**22


class TRAK:
    """TRAK over a training set streamed from batches, its features kept on disk.

    ``TRAK(fn, checkpoints, path, ...)`` opens (or, on the first :meth:`featurize`, creates)
    a feature store in the folder ``path``. :meth:`featurize` streams the training set through
    every model once; :meth:`score` and :meth:`top_k` then score any number of target batches
    against the stored features without recomputing them. The scores equal
    :func:`pergrad.influence.trak` on the same data, weights, seed and damping.

    ``proj_dim``, ``seed``, ``kind``, ``projection`` and ``factored_dims`` left as None take
    the stored values when ``path`` holds a store (the defaults otherwise); a value given that
    differs from the stored one is an error.

    Args:
      fn: the model OUTPUT of one example, ``fn(params, *example) -> scalar`` (the margin for
        classification), as for :func:`pergrad.influence.trak`.
      checkpoints: a non-empty list of parameter pytrees, one per model. Reopening a store
        checks them against a fingerprint of each stored model's parameters (and their order).
      path: the store's folder (created if missing).
      weight_fn: TRAK's ``Q`` of one example, as for :func:`pergrad.influence.trak`; used by
        :meth:`featurize` (the weights are stored; scoring needs no ``weight_fn``).
      proj_dim: as for :func:`pergrad.influence.trak` (default 2048).
      seed: as for :func:`pergrad.influence.trak` (default 0; model ``m`` uses ``seed + m``).
      kind: ``"rademacher"`` (default) or ``"gaussian"``.
      projection: ``"dense"`` (default) or ``"factored"``.
      factored_dims: ``(k_in, k_out)`` for ``projection="factored"`` (default ``(16, 16)``).
      chunk_size: per-example gradients of this many examples at a time within a batch.

    Example::

        trak = pergrad.influence.TRAK(margin, [params_1, params_2], "trak_features",
                                      weight_fn=weight, proj_dim=2048)
        trak.featurize(train_loader)                     # once; progress bar; resumable
        scores = trak.score((X_test, Y_test), damping=1e-2)   # (n_train, n_test)
        best = trak.top_k((X_new, Y_new), k=10, damping=1e-2)  # TopK, rows streamed

        # later, in another process: no featurisation, the options come from the store
        trak = pergrad.influence.TRAK(margin, [params_1, params_2], "trak_features")

    Cost, per model: :meth:`featurize` costs, per training example, one per-example gradient,
    ``2 P k`` flops of projection (the ``(P, k)`` matrix is drawn once when the models'
    matrices hold at most 2**26 numbers together, else block by block for every batch) and
    ``D^2`` for the Gram matrix; on disk ``n_train x D x 4`` bytes of features (``D = k`` for
    the dense projection), ``n_train x 4`` of weights and ``D^2 x 8`` of Gram matrix in
    ``state.npz``. :meth:`score` costs one ``D x D`` eigendecomposition per model (on the
    first call only), the targets' features, and one read of the stored features with
    ``2 n_train D n_targets`` flops; memory ``chunk_rows x (D + n_targets)`` plus the output.
    Measured on a shared 2-core CPU (PyTorch, a 784-128-10 MLP, ``P = 101,632``, batches of
    256): 13 ms per example with the dense projection at ``k = 512``; 2.4 ms with
    ``projection="factored"``, ``factored_dims=(32, 8)`` (``D = 768``); at ``k = 2048`` the
    dense matrix no longer fits and is redrawn every batch: 65 ms per example.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        checkpoints: Sequence[Any],
        path: str | os.PathLike[str],
        *,
        weight_fn: Callable[..., Any] | None = None,
        proj_dim: int | None = None,
        seed: int | None = None,
        kind: str | None = None,
        projection: str | None = None,
        factored_dims: tuple[int, int] | None = None,
        chunk_size: int | None = None,
    ) -> None:
        name = "TRAK"
        check_checkpoints(name, checkpoints)
        if not isinstance(path, (str, os.PathLike)):
            raise PergradTypeError(
                f"{name}: path must be a folder path (str or os.PathLike) for the feature "
                f"store; got {type(path).__name__}."
            )
        if weight_fn is not None:
            check_fn(name, weight_fn, "weight_fn")
        self.path = Path(path)
        self.weight_fn = weight_fn
        self._meta = read_meta(self.path)
        given = {
            "proj_dim": proj_dim,
            "seed": seed,
            "kind": kind,
            "projection": projection,
            "factored_dims": tuple(factored_dims) if factored_dims is not None else None,
        }
        self.options = resolve_options(name, self.path, self._meta, given)
        # the models' projection matrices are kept while they fit MAX_MATRIX_NUMBERS together
        budget = MAX_MATRIX_NUMBERS // len(checkpoints)
        self._models = [
            ModelFeaturizer(name, fn, params, index, self.options, chunk_size, budget)
            for index, params in enumerate(checkpoints)
        ]
        self._fingerprints = [fingerprint(model) for model in self._models]
        if self._meta is not None:
            self._check_models()
        self._eighs: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}

    # ----------------------------------------------------------------------------------------
    # What the store holds.

    @property
    def num_train(self) -> int:
        """Training examples stored (0 before :meth:`featurize`)."""
        return read_state(self.path)["num_written"]

    @property
    def complete(self) -> bool:
        """Whether the last :meth:`featurize` read its stream to the end."""
        return read_state(self.path)["complete"]

    @property
    def feature_dim(self) -> int:
        """``D``, the columns of each model's features (``proj_dim`` for the dense projection;
        0 before :meth:`featurize`)."""
        return read_state(self.path)["feature_dim"]

    def features(self, model: int = 0) -> np.ndarray:
        """Model ``model``'s stored features ``Phi_m``, a read-only ``(num_train, D)`` float32
        ``np.memmap`` (row ``i``: the ``i``-th example streamed)."""
        state = read_state(self.path)
        return memmap(self.path, "features", self._index(model), state, state["feature_dim"])

    def weights(self, model: int = 0) -> np.ndarray | None:
        """Model ``model``'s stored ``Q`` ``(num_train,)`` float32, or None without
        ``weight_fn``."""
        if not self._meta_or_raise("weights")["weighted"]:
            return None
        state = read_state(self.path)
        return memmap(self.path, "weights", self._index(model), state, None)

    # ----------------------------------------------------------------------------------------
    # Featurisation.

    def featurize(
        self,
        train_batches: Iterable[Sequence[Any]],
        *,
        resume: bool = False,
        progress: bool | None = None,
    ) -> int:
        """Stream the training set through every model; append features and weights on disk.

        Args:
          train_batches: an iterable of tuples of ``fn``'s batched arguments (a DataLoader, a
            generator reading shards), batches of any sizes; read once. Row ``i`` of the store
            is the ``i``-th example streamed.
          resume: continue a store that already holds examples (an interrupted run, or more
            data to add): the first ``num_train`` examples of ``train_batches`` are skipped
            without computing anything, so pass the same stream in the same order. Without
            it, a store that holds examples is an error.
          progress: a tqdm progress bar (default: when tqdm is installed).

        Returns:
          The number of training examples stored.

        The state is saved whole batches at a time: at least every minute, and when this
        returns or raises (Ctrl-C included); rows written after the last save by a process
        that was killed are dropped on ``resume``. One process writes a store at a time.
        """
        name = "TRAK.featurize"
        if not isinstance(resume, bool):
            raise PergradTypeError(f"{name}: resume must be True or False; got {resume!r}.")
        writer = _Writer.open(name, self, resume)
        try:
            for batch in with_progress(train_batches, progress, name, "featurizing batches"):
                writer.add(batch)
            writer.finish()
        finally:
            writer.close()
        return writer.num_written

    # ----------------------------------------------------------------------------------------
    # Scoring.

    def score(
        self,
        target_batch: Sequence[Any],
        *,
        damping: float | Sequence[float] = 0.0,
        target_fn: Callable[..., Any] | None = None,
        chunk_rows: int | None = None,
    ) -> Any:
        """TRAK scores of every stored training example for each target.

        Args:
          target_batch: tuple of ``fn``'s (or ``target_fn``'s) batched arguments.
          damping: as for :func:`pergrad.influence.trak` (a list gives one matrix per value).
          target_fn: the output of one target, if not ``fn``.
          chunk_rows: stored rows read at once (default: ``rows x D`` under 2**22 numbers).

        Returns:
          ``(num_train, n_targets)`` scores (``(len(damping), num_train, n_targets)`` for a
          list), an array of the checkpoints' framework.
        """
        name = "TRAK.score"
        grid = check_dampings(name, damping)
        solved, like, state = self._solved(name, target_batch, target_fn, grid)
        result = np.empty((len(grid), state["num_written"], solved[0].shape[2]))
        for start, block in self._row_blocks(name, solved, state, chunk_rows):
            result[:, start : start + block.shape[1]] = block
        result = as_backend_array(self._models[0].backend, result, like)
        return result if isinstance(damping, (list, tuple)) else result[0]

    def top_k(
        self,
        target_batch: Sequence[Any],
        k: int = 10,
        *,
        damping: float = 0.0,
        target_fn: Callable[..., Any] | None = None,
        chunk_rows: int | None = None,
    ) -> TopK:
        """Each target's ``k`` highest- and lowest-scoring training examples.

        As :meth:`score` (one ``damping``), but never holding ``num_train x n_targets``
        scores: each chunk of stored rows is ranked and merged into the running result
        (:func:`pergrad.influence.merge_top_k`; equal scores go to the lower index).

        Returns:
          A :class:`pergrad.influence.TopK` of numpy arrays; indices are rows of the store.
        """
        name = "TRAK.top_k"
        if isinstance(damping, (list, tuple)):
            raise PergradValueError(f"{name}: damping must be one number; got a list {damping}.")
        grid = check_dampings(name, damping)
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise PergradValueError(f"{name}: k must be a positive int; got {k!r}.")
        solved, _, state = self._solved(name, target_batch, target_fn, grid)
        merged = None
        for start, block in self._row_blocks(name, solved, state, chunk_rows):
            part = top_k_from_scores(block[0], k, offset=start)
            merged = part if merged is None else merge_top_k([merged, part], k)
        return merged

    def _solved(
        self, name: str, target_batch: Any, target_fn: Any, grid: list[float]
    ) -> tuple[list[np.ndarray], Any, dict[str, Any]]:
        """Per model ``(G_m + d I)^-1 phi_m^T`` ``(len(grid), D, n_targets)``, an array of the
        targets' features (for the output's framework) and the store's state."""
        state = self._readable_state(name)
        solved, like = [], None
        for index, model in enumerate(self._models):
            targets, count = check_batch(name, "target_batch", model.backend, target_batch)
            phi_target = model.features(targets, count, target_fn)
            like = phi_target if like is None else like
            if index not in self._eighs:
                self._eighs[index] = eigh_psd(state["grams"][index])
            target = model.backend.to_numpy(phi_target).astype(np.float64)
            if target.shape[1] != state["feature_dim"]:
                raise PergradValueError(
                    f"{name}: the targets' features have {target.shape[1]} columns but the "
                    f"stored ones {state['feature_dim']}; with projection='factored', fn and "
                    f"target_fn must go through the same layers."
                )
            solved.append(solve_eigh(self._eighs[index], target.T, grid))
        return solved, like, state

    def _row_blocks(
        self, name: str, solved: list[np.ndarray], state: dict[str, Any], chunk_rows: Any
    ) -> Iterator[tuple[int, np.ndarray]]:
        """``(start, (len, rows, n_targets) scores)`` over the stored rows, in order."""
        dim, total = state["feature_dim"], state["num_written"]
        if chunk_rows is None:
            chunk_rows = max(1, DEFAULT_ROW_NUMBERS // dim)
        elif isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows <= 0:
            raise PergradValueError(
                f"{name}: chunk_rows must be a positive int or None; got {chunk_rows!r}."
            )
        count = len(self._models)
        features = [memmap(self.path, "features", m, state, dim) for m in range(count)]
        weighted = self._meta["weighted"]
        weights = [memmap(self.path, "weights", m, state, None) for m in range(count) if weighted]
        for start in range(0, total, chunk_rows):
            stop = min(start + chunk_rows, total)
            block = sum(
                np.asarray(features[m][start:stop], dtype=np.float64) @ solved[m]
                for m in range(count)
            )
            block = block / count
            if weighted:
                mean = sum(np.asarray(weights[m][start:stop], np.float64) for m in range(count))
                block = block * (mean / count)[None, :, None]
            yield start, block

    # ----------------------------------------------------------------------------------------
    # Checks.

    def _index(self, model: Any) -> int:
        count = len(self._models)
        if isinstance(model, bool) or not isinstance(model, int) or not 0 <= model < count:
            raise PergradValueError(
                f"TRAK: model must be an int in [0, {count}) (one per checkpoint); got {model!r}."
            )
        return model

    def _meta_or_raise(self, name: str) -> dict[str, Any]:
        if self._meta is None:
            raise PergradValueError(
                f"TRAK.{name}: {self.path} holds no TRAK features yet; call "
                f"featurize(train_batches) first."
            )
        return self._meta

    def _readable_state(self, name: str) -> dict[str, Any]:
        self._meta_or_raise(name.split(".")[-1])
        state = read_state(self.path, grams=True)
        if state["num_written"] == 0 or not state["complete"]:
            raise PergradValueError(
                f"{name}: the features at {self.path} are incomplete ({state['num_written']} "
                f"examples written, then featurize stopped); finish them with "
                f"featurize(train_batches, resume=True) before scoring."
            )
        return state

    def _check_models(self) -> None:
        meta = self._meta
        stored = meta["models"]
        if len(stored) != len(self._models):
            raise PergradValueError(
                f"TRAK: the features at {self.path} were made with {len(stored)} checkpoints; "
                f"got {len(self._models)}. Pass the same checkpoints in the same order (or "
                f"use another path for a new store)."
            )
        for index, (entry, expected) in enumerate(zip(stored, self._fingerprints)):
            if entry != expected:
                raise PergradValueError(
                    f"TRAK: checkpoints[{index}] is not the model whose features are stored at "
                    f"{self.path} (stored: {entry['num_parameters']} parameters, "
                    f"{entry['dtype']}, fingerprint {entry['sample_hash'][:12]}; got "
                    f"{expected['num_parameters']}, {expected['dtype']}, fingerprint "
                    f"{expected['sample_hash'][:12]}). Pass the same checkpoints in the "
                    f"same order, with their parameters flattened in the same order."
                )

    def _create_meta(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        options = self.options
        self._meta = {
            "format": FORMAT,
            "framework": self._models[0].backend.name,
            "options": {
                "proj_dim": options.proj_dim,
                "seed": options.seed,
                "kind": options.kind,
                "projection": options.projection,
                "factored_dims": list(options.factored_dims),
            },
            "weighted": self.weight_fn is not None,
            "disk_dtype": DISK_DTYPE.str,
            "models": self._fingerprints,
        }
        atomic_write(self.path / META, json.dumps(self._meta, indent=2).encode())


class _Writer:
    """Appends batches to a store, keeping its Gram matrices and saving its state."""

    def __init__(self, name: str, trak: TRAK, state: dict[str, Any]) -> None:
        self.name, self.trak = name, trak
        self.num_written = state["num_written"]
        self.dim = state["feature_dim"]
        self.grams = state["grams"]
        self.skip = self.num_written
        self.complete = False
        self.saved_at = time.monotonic()
        count = len(trak._models)
        self.files = [open(store_file(trak.path, "features", m), "ab") for m in range(count)]  # noqa: SIM115
        weighted = trak._meta["weighted"]
        self.weight_files = [
            open(store_file(trak.path, "weights", m), "ab")  # noqa: SIM115
            for m in range(count)
            if weighted
        ]

    @classmethod
    def open(cls, name: str, trak: TRAK, resume: bool) -> _Writer:
        count = len(trak._models)
        if trak._meta is None:
            trak._create_meta()
            kinds = ("features", "weights") if trak._meta["weighted"] else ("features",)
            for kind in kinds:
                for m in range(count):
                    store_file(trak.path, kind, m).write_bytes(b"")
            write_state(trak.path, {"num_written": 0, "complete": False, "grams": None})
        else:
            weighted = trak._meta["weighted"]
            if weighted != (trak.weight_fn is not None):
                raise PergradValueError(
                    f"{name}: the features at {trak.path} were made "
                    f"{'with' if weighted else 'without'} weight_fn; pass "
                    f"{'the same weight_fn' if weighted else 'no weight_fn'} to TRAK to add "
                    f"to them."
                )
        state = read_state(trak.path, grams=True)
        if state["num_written"] and not resume:
            status = "complete" if state["complete"] else "interrupted"
            raise PergradValueError(
                f"{name}: {trak.path} already holds the features of {state['num_written']} "
                f"examples ({status}); pass resume=True to continue with the same stream (its "
                f"first {state['num_written']} examples are skipped) or to add examples after "
                f"them, or use another path."
            )
        truncate(trak.path, count, state)
        return cls(name, trak, state)

    def add(self, batch: Any) -> None:
        models = self.trak._models
        batch, count = check_batch(self.name, "each training batch", models[0].backend, batch)
        if self.skip >= count:
            self.skip -= count
            return
        if self.skip:
            batch, count = (
                slice_batch(models[0].backend, batch, self.skip, count),
                count - self.skip,
            )
            self.skip = 0
        rows = [to_disk(m, m.features(batch, count)) for m in models]
        weight_fn = self.trak.weight_fn
        weights = [to_disk(m, m.weights(weight_fn, batch, count)) for m in models if weight_fn]
        self._check_dim(rows[0].shape[1])
        if self.grams is None:
            self.grams = np.zeros((len(models), self.dim, self.dim))
        for index, row in enumerate(rows):
            self.files[index].write(row.tobytes())
        for file, weight in zip(self.weight_files, weights):
            file.write(weight.tobytes())
        for index, row in enumerate(rows):
            wide = row.astype(np.float64)
            self.grams[index] += wide.T @ wide
        self.num_written += count
        if time.monotonic() - self.saved_at > SAVE_SECONDS:
            self.save()

    def _check_dim(self, dim: int) -> None:
        if self.dim == 0:
            self.dim = dim
        elif dim != self.dim:
            raise PergradValueError(
                f"{self.name}: a batch gave {dim} feature columns but the store holds {self.dim}."
            )

    def finish(self) -> None:
        if self.skip:
            raise PergradValueError(
                f"{self.name}: train_batches ended {self.skip} examples before the "
                f"{self.num_written} already stored; resume with the same stream in the same "
                f"order."
            )
        if self.num_written == 0:
            raise PergradValueError(f"{self.name}: train_batches yielded no examples.")
        self.complete = True

    def save(self) -> None:
        for file in self.files + self.weight_files:
            file.flush()
            os.fsync(file.fileno())
        state = {"num_written": self.num_written, "complete": self.complete, "grams": self.grams}
        write_state(self.trak.path, state)
        self.saved_at = time.monotonic()

    def close(self) -> None:
        try:
            self.save()
        finally:
            for file in self.files + self.weight_files:
                file.close()
