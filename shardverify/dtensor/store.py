"""Stored results of `shardverify dtensor --results DIR`: one JSON file per (op spec content,
mesh, torch version, limit), so a run over every spec (hours on a shared machine) can stop at
any point and continue where it stopped, and later sessions add to it.

A file holds every case of the spec on that mesh as far as it ran: a finished case, and the
case in progress with the combinations it executed (they run in a fixed order, so it resumes at
the next one). A spec whose file changed gets a new hash, so its old results are never reused
for it; a run with another ``--budget`` re-runs the cases (``too-slow`` depends on it), and so
does a run stored by another version of the harness (:data:`HARNESS`).
Findings are stored without their repro scripts (``--repros`` needs a fresh run).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from shardverify.errors import SpecError

__all__ = ["HARNESS", "StoredRun", "spec_hash", "store_path", "load_stored", "save_stored"]

VERSION = 1

#: The DTensor harness's behaviour version. Bump it with any change to how a combination is built,
#: executed or classified (execute.py, hooks.py, verdicts.py...) that can change a stored outcome:
#: a run stored under another version is never read as this harness's: a run with ``--results``
#: runs it again, ``--from-json`` leaves it out and says so. (Results are keyed by the spec file's
#: hash; without this, a fixed harness bug lived on in the store: conv1d's nn.Module results, made
#: before CommDebugMode's module hooks were taken out of the forward, kept a silent class that real
#: gloo processes showed to be a late failure.) Files from before the field are version 1.
HARNESS = 1


def spec_hash(spec, root: Path = Path(".")) -> str:
    """The first 12 hex digits of the sha256 of the spec's file."""
    path = Path(spec.source)
    if not path.is_absolute() and not path.exists():
        path = root / path
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


@dataclass
class StoredRun:
    """One spec on one mesh: its cases (in order), the results of those that ran, which are done."""

    spec: str
    spec_hash: str
    mesh: tuple[int, ...]
    torch: str
    limit: int | None
    budget: float | None
    cases: list[str] = field(default_factory=list)
    results: dict = field(default_factory=dict)      # case id -> CaseResult as to_json saves it
    done: list[str] = field(default_factory=list)    # case ids finished
    died: dict = field(default_factory=dict)         # case id -> {combination index: the stage a process died in}
    harness: int = HARNESS                           # the harness version that made it

    @property
    def complete(self) -> bool:
        return bool(self.cases) and all(c in self.done for c in self.cases)

    def to_json(self) -> dict:
        return {"version": VERSION, "spec": self.spec, "spec_hash": self.spec_hash, "mesh": list(self.mesh),
                "torch": self.torch, "limit": self.limit, "budget": self.budget, "complete": self.complete,
                "cases": self.cases, "done": self.done, "died": self.died, "harness": self.harness,
                "results": {case: _slim(result) for case, result in self.results.items()}}

    @classmethod
    def from_json(cls, item: dict) -> "StoredRun":
        if item.get("version") != VERSION:
            raise ValueError(f"stored-result version {item.get('version')!r}, this shardverify reads {VERSION}")
        results = {case: _whole(result) for case, result in item["results"].items()}
        return cls(item["spec"], item["spec_hash"], tuple(item["mesh"]), item["torch"], item["limit"],
                   item["budget"], list(item["cases"]), results, list(item["done"]), dict(item.get("died", {})),
                   int(item.get("harness", 1)))


#: what every finding of a case repeats from the case (and its class key, recomputed on reading)
_REPEATED = ("op", "case", "mesh", "key")


def _slim(result: dict) -> dict:
    """A case's result without what its findings repeat (the stored results stay small enough to commit)."""
    return {**result, "findings": [{k: v for k, v in f.items() if k not in _REPEATED} for f in result["findings"]]}


def _whole(result: dict) -> dict:
    """:func:`_slim` undone: each finding gets its case's op, case and mesh back."""
    same = {"op": result["op"], "case": result["case"], "mesh": result["mesh"]}
    return {**result, "findings": [{**same, **f} for f in result["findings"]]}


def store_path(folder: Path, spec_name: str, digest: str, mesh, torch_version: str, limit: int | None) -> Path:
    """DIR/torch-VERSION/SPEC.MESH.limitN.HASH.json (limit0: every combination)."""
    mesh_text = "x".join(map(str, mesh))
    return folder / f"torch-{torch_version}" / f"{spec_name}.{mesh_text}.limit{limit or 0}.{digest}.json"


def load_stored(path: Path) -> StoredRun | None:
    """The stored run at ``path``, or None when there is none; SpecError when it cannot be read."""
    if not path.exists():
        return None
    try:
        return StoredRun.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SpecError(f"{path}: not a stored `shardverify dtensor --results` file "
                        f"({type(exc).__name__}: {str(exc)[:200]}); remove it to run that spec again") from exc


def save_stored(path: Path, run: StoredRun) -> None:
    """Written whole or not at all (a run killed mid-write leaves the previous file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(run.to_json(), separators=(",", ":")) + "\n")
    os.replace(tmp, path)
