"""The calibration file: per-axis alpha and beta of a mesh, written by ``shardverify calibrate``
(:mod:`shardverify.backends.calibration` measures and fits them) and read by
:meth:`DeviceMesh.calibrated`.

* the file: ``--out``, else ``$SHARDVERIFY_CALIBRATION``, else ``~/.cache/shardverify/calibration.json``;
* its layout: ``{"format": 1, "meshes": {"2,2": {"alpha": [...], "beta": [...], "backend": ...,
  "device": ..., "fit": [...], "measured_at": ...}}}``; calibrating another mesh shape adds an entry.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardverify.errors import MeshError, SpecError
from shardverify.files import read_regular_file, write_file_atomic

__all__ = ["ENV_VAR", "DEFAULT_PATH", "FORMAT", "AxisFit", "calibration_path", "save_calibration", "load_calibration",
           "load_rate"]

ENV_VAR = "SHARDVERIFY_CALIBRATION"
DEFAULT_PATH = Path("~/.cache/shardverify/calibration.json")
MAX_CALIBRATION_BYTES = 16 << 20   # per-axis alpha/beta of every mesh measured: kilobytes in practice
FORMAT = 1


@dataclass(frozen=True)
class AxisFit:
    axis: int
    alpha: float
    beta: float
    rel_rms: float      # root-mean-square relative error of the fitted times
    points: int


def calibration_path(path: str | os.PathLike | None = None) -> Path:
    """Where the calibration file is read and written: ``path``, ``$SHARDVERIFY_CALIBRATION``, the default."""
    chosen = path if path is not None else os.environ.get(ENV_VAR) or DEFAULT_PATH
    return Path(chosen).expanduser()


def _key(shape: Sequence[int]) -> str:
    return ",".join(str(int(s)) for s in shape)


def save_calibration(mesh_shape: Sequence[int], fits: Sequence[AxisFit], *, backend: str, device: str,
                     path: str | os.PathLike | None = None, multiply_adds_per_s: float | None = None) -> Path:
    """Write (or add) the entry of ``mesh_shape`` (with the ranks' measured arithmetic rate when
    given); returns the file written."""
    target = calibration_path(path)
    document = {"format": FORMAT, "meshes": {}}
    if target.exists():
        document = _read(target)
    document["meshes"][_key(mesh_shape)] = {
        "alpha": [f.alpha for f in fits], "beta": [f.beta for f in fits], "backend": backend, "device": device,
        "fit": [{"axis": f.axis, "rel_rms": f.rel_rms, "points": f.points} for f in fits],
        **({"multiply_adds_per_s": multiply_adds_per_s} if multiply_adds_per_s else {}),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(target, json.dumps(document, indent=2) + "\n")
    return target


def _read(target: Path) -> dict:
    try:
        document = json.loads(read_regular_file(target, MAX_CALIBRATION_BYTES))
    except SpecError as exc:   # a FIFO, a device, a folder or an oversized file: refused unread
        raise MeshError(f"calibration file {target}: {exc.reason}") from None
    except (OSError, ValueError) as exc:
        raise MeshError(f"calibration file {target}: cannot read it as JSON: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT or not isinstance(document.get("meshes"), dict):
        raise MeshError(f"calibration file {target}: expected {{\"format\": {FORMAT}, \"meshes\": {{...}}}}, "
                        f"written by `shardverify calibrate`")
    return document


def load_calibration(mesh_shape: Sequence[int], path: str | os.PathLike | None = None
                     ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(alpha, beta) per axis of ``mesh_shape`` from the calibration file (see :func:`calibration_path`)."""
    entry, target = _entry(mesh_shape, path)
    alpha, beta = entry.get("alpha"), entry.get("beta")
    ndim = len(tuple(mesh_shape))
    for name, values in (("alpha", alpha), ("beta", beta)):
        if not isinstance(values, list) or len(values) != ndim or \
                not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise MeshError(f"calibration file {target}, mesh {_key(mesh_shape)}: {name} must be a list of "
                            f"{ndim} numbers, got {values!r}")
    return tuple(float(v) for v in alpha), tuple(float(v) for v in beta)


def load_rate(mesh_shape: Sequence[int], path: str | os.PathLike | None = None) -> float | None:
    """The ranks' measured multiply-adds per second for ``mesh_shape``; None when not measured."""
    entry, target = _entry(mesh_shape, path)
    rate = entry.get("multiply_adds_per_s")
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < float("inf"):
        raise MeshError(f"calibration file {target}, mesh {_key(mesh_shape)}: multiply_adds_per_s must be a "
                        f"positive number, got {rate!r}")
    return float(rate)


def _entry(mesh_shape: Sequence[int], path: str | os.PathLike | None) -> tuple[dict, Path]:
    """The calibration file's entry of ``mesh_shape``, and the file."""
    target = calibration_path(path)
    if not target.exists():
        raise MeshError(f"no calibration file at {target}; run `shardverify calibrate --backend gloo "
                        f"--mesh {_key(mesh_shape)}` (or set ${ENV_VAR})")
    meshes = _read(target)["meshes"]
    entry = meshes.get(_key(mesh_shape))
    if entry is None:
        raise MeshError(f"calibration file {target} has no entry for mesh {_key(mesh_shape)}; it has "
                        f"{sorted(meshes) or 'none'}")
    if not isinstance(entry, dict):
        raise MeshError(f"calibration file {target}, mesh {_key(mesh_shape)}: expected an object, got {entry!r}")
    return entry, target
