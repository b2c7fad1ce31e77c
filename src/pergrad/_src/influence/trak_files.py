"""The files of a :class:`~pergrad._src.influence.trak_store.TRAK` store: its format, metadata,
saved state and feature files (``trak_store.py`` has the layout).

Every write that describes the store (``trak.json``, ``state.npz``) replaces its file
atomically, so a killed process leaves the last whole state behind; feature rows written after
it are cut off by :func:`truncate` when the store is resumed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from pergrad._src.errors import PergradValueError
from pergrad._src.influence.trak import ModelFeaturizer, TrakOptions

FORMAT = "pergrad.trak/1"
META, STATE = "trak.json", "state.npz"
DISK_DTYPE = np.dtype("<f4")
# The state (Gram matrices and the count of examples) is saved at least this often while
# featurising, and whenever featurize returns or raises.
SAVE_SECONDS = 60.0
# Numbers of a fingerprint's sample of each checkpoint's flat parameters.
FINGERPRINT_NUMBERS = 2**16


def to_disk(model: ModelFeaturizer, values: Any) -> np.ndarray:
    return np.ascontiguousarray(model.backend.to_numpy(values), dtype=DISK_DTYPE)


def resolve_options(
    name: str, path: Path, meta: dict[str, Any] | None, given: dict[str, Any]
) -> TrakOptions:
    """The options given, the stored ones where not given, the defaults for a new store."""
    defaults = TrakOptions()
    explicit = TrakOptions(
        **{key: getattr(defaults, key) if value is None else value for key, value in given.items()}
    )
    explicit.check(name)
    if meta is None:
        return explicit
    stored = dict(meta["options"], factored_dims=tuple(meta["options"]["factored_dims"]))
    for key, value in given.items():
        if value is not None and value != stored[key]:
            raise PergradValueError(
                f"{name}: {key}={value!r} but the features at {path} were made with "
                f"{key}={stored[key]!r}; leave {key} out to use them, or use another path."
            )
    return TrakOptions(**stored)


def fingerprint(model: ModelFeaturizer) -> dict[str, Any]:
    """A cheap identity of a model: its size, dtype and a hash of an even sample of its flat
    parameters (the flattening order included, which also orders the projection's rows)."""
    vector = model.output.flat.vector
    size = model.output.flat.size
    stride = max(1, size // FINGERPRINT_NUMBERS)
    sample = np.ascontiguousarray(model.backend.to_numpy(vector[::stride]))
    return {
        "num_parameters": size,
        "dtype": str(sample.dtype),
        "sample_hash": hashlib.blake2b(sample.tobytes(), digest_size=16).hexdigest(),
    }


def store_file(path: Path, kind: str, model: int) -> Path:
    return path / f"{kind}_{model}.f32"


def memmap(path: Path, kind: str, model: int, state: dict[str, Any], dim: int | None) -> np.ndarray:
    shape = (state["num_written"],) if dim is None else (state["num_written"], dim)
    if state["num_written"] == 0:
        return np.zeros(shape if dim else (0,), DISK_DTYPE)
    return np.memmap(store_file(path, kind, model), dtype=DISK_DTYPE, mode="r", shape=shape)


def truncate(path: Path, count: int, state: dict[str, Any]) -> None:
    """Cut each file to the rows the saved state counts (a killed run may have written more)."""
    rows = state["num_written"]
    for kind, width in (("features", state["feature_dim"]), ("weights", 1)):
        for model in range(count):
            file = store_file(path, kind, model)
            if not file.exists():
                continue
            expected = rows * width * DISK_DTYPE.itemsize
            size = file.stat().st_size
            if size < expected:
                raise PergradValueError(
                    f"TRAK.featurize: {file} holds {size} bytes, fewer than the {expected} its "
                    f"{rows} saved examples need; the store is damaged, featurize into a new "
                    f"path."
                )
            if size > expected:
                os.truncate(file, expected)


def read_meta(path: Path) -> dict[str, Any] | None:
    file = path / META
    if not file.exists():
        return None
    meta = json.loads(file.read_text())
    if meta.get("format") != FORMAT:
        raise PergradValueError(
            f"TRAK: {file} is not a pergrad TRAK store of format {FORMAT!r} (its format: "
            f"{meta.get('format')!r})."
        )
    return meta


def read_state(path: Path, grams: bool = False) -> dict[str, Any]:
    """The saved state: ``num_written``, ``complete``, ``feature_dim`` (0 before the first
    batch) and, if asked, ``grams`` ``(models, D, D)`` float64 (None before the first batch)."""
    file = path / STATE
    if not file.exists():
        return {"num_written": 0, "complete": False, "feature_dim": 0, "grams": None}
    with np.load(file) as data:
        dim = int(data["feature_dim"])
        return {
            "num_written": int(data["num_written"]),
            "complete": bool(data["complete"]),
            "feature_dim": dim,
            "grams": data["grams"] if grams and dim else None,
        }


def write_state(path: Path, state: dict[str, Any]) -> None:
    grams = state["grams"] if state["grams"] is not None else np.zeros((0, 0, 0))
    temporary = path / (STATE + ".tmp")
    with open(temporary, "wb") as file:
        np.savez(
            file,
            num_written=state["num_written"],
            complete=state["complete"],
            feature_dim=grams.shape[1],
            grams=grams,
        )
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path / STATE)


def atomic_write(file: Path, data: bytes) -> None:
    temporary = file.with_name(file.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, file)
