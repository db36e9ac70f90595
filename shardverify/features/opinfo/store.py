"""The OpInfo sweep's results on disk, one file per OpInfo entry, so a sweep resumes where it
stopped and a rerun sweeps only the entries whose specs changed.

An entry's file holds its calls' outcomes and what they depend on: the sweep's settings (samples,
meshes, captures, seed, torch version) and the rule text of every handler that could take its
calls (the ones that took them, those sharing a target with them, and those now registered for a
target no handler took). A file whose settings or rule texts differ from today's is stale and
swept again. What it cannot see is a change in shardverify's own code: the file records the commit
it was swept at, the report names those commits, and ``--opinfo-fresh`` sweeps every entry again.
A file is read and written through :mod:`shardverify.stored` and checked field by field: one
that does not check is swept again (:func:`load_entry`); an entry's name is a file name only when
it is a plain one (else its plain letters and a digest).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shardverify.backends.liveness import process_alive, process_start
from shardverify.errors import SpecError, shorten
from shardverify.files import read_regular_file
from shardverify.features.opinfo.sweep import OUTCOMES, CallOutcome, SweepResult
from shardverify.spec.limits import MAX_JSON_BYTES
from shardverify.strategies.handlers.base import HandlerDef, registered_handlers, target_key
from shardverify.stored import StoreError, items, need, read_json, safe_name, write_json
from shardverify.verify.on_demand import default_cache_dir, no_cache_reason, rule_text

__all__ = ["RESULT_FORMAT", "default_results_dir", "settings_key", "load_entry", "save_entry", "source_commit",
           "claim_entry", "release_entry", "rule_digests", "held", "lock_owner", "LockOwner"]

RESULT_FORMAT = 1
NO_HANDLER = "captured as "
_LEGACY = {"constant": "folded"}   # the outcome's first name, in files swept before it was renamed


def default_results_dir() -> Path:
    """Beside the on-demand verdict cache: ``~/.cache/shardverify/opinfo``; SpecError when there is
    no such place (no ``$HOME``, no ``$SHARDVERIFY_CACHE_DIR``): the folder must then be given."""
    cache = default_cache_dir()
    if cache is None:
        raise SpecError(f"no default folder ({no_cache_reason().removeprefix('no verdict cache: ')}): "
                        "give --opinfo-results DIR", file="--opinfo-results")
    return cache.parent / "opinfo"


def settings_key(limit: int, meshes, captures, seed: int) -> dict:
    return {"format": RESULT_FORMAT, "torch": torch.__version__, "limit": limit, "seed": seed,
            "meshes": [list(m) for m in meshes], "captures": list(captures)}


@functools.cache
def source_commit() -> str:
    """The git commit shardverify's code was at when this process first asked (``+dirty`` with
    uncommitted changes), else '': once, as the code a process runs is the code it loaded."""
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "shardverify", "specs"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if head and dirty else "")


def target_text(target: object) -> str:
    """A target as :func:`shardverify.capture.call.target_name` writes a node calling it."""
    key = target_key(target)
    if isinstance(key, str):
        return f"Tensor.{key}"
    if isinstance(key, type):
        return f"{key.__module__}.{key.__qualname__}"
    return str(key) if not callable(key) or hasattr(key, "_schema") else \
        f"{getattr(key, '__module__', '') or ''}.{getattr(key, '__qualname__', repr(key))}".lstrip(".")


@functools.cache
def rule_digests() -> dict[str, str]:
    """name -> digest of each registered handler's rule text, read once: the rules this process
    loaded, whatever the spec files say by the time an entry is saved."""
    return {name: hashlib.sha256(rule_text(h).encode()).hexdigest()[:16] for name, h in registered_handlers().items()}


def _depends_on(outcomes: list[CallOutcome]) -> dict[str, str]:
    """name -> rule-text digest of every handler that could take these calls."""
    handlers = registered_handlers()
    digests = rule_digests()
    took = {name for o in outcomes for name in o.served_by}
    untaken = {o.reason.removeprefix(NO_HANDLER) for o in outcomes if o.outcome == "no-handler"}
    targets = {target_text(t) for name in took if name in handlers for t in handlers[name].targets} | untaken
    chosen: dict[str, HandlerDef] = {name: h for name, h in handlers.items()
                                     if name in took or any(target_text(t) in targets for t in h.targets)}
    return {name: digests[name] for name in sorted(chosen)}


def _file(folder: Path, entry: str, suffix: str = ".json") -> Path:
    return Path(folder) / f"{safe_name(entry)}{suffix}"


def save_entry(folder: Path, entry: str, settings: dict, result: SweepResult) -> None:
    """Write the entry's results whole or not at all (a stopped run leaves no half file)."""
    document = {"settings": settings, "entry": entry, "commit": source_commit(), "seconds": result.seconds,
                "depends_on": _depends_on(result.outcomes), "defects": result.defects,
                "outcomes": [asdict(o) for o in result.outcomes]}
    write_json(_file(folder, entry), document, indent=0)


#: a stored outcome's fields and their kinds (lists stand for the tuples)
_OUTCOME = {"op": str, "sample": str, "capture": str, "mesh": list, "outcome": str, "reason": str,
            "served_by": list, "strategies": int, "sharded": int, "checked": int, "wrong": list,
            "wrong_extremum": list}
_REQUIRED = ("op", "sample", "capture", "mesh", "outcome")


def _outcome(item: object, file: str, where: str) -> CallOutcome:
    """One stored call outcome, checked field by field (StoreError naming the field)."""
    fields = {}
    for name, kind in _OUTCOME.items():
        if name not in _REQUIRED and isinstance(item, dict) and name not in item:
            continue          # the dataclass's default
        value = need(item, name, kind, file=file, where=where)
        if kind is list:
            value = tuple(items(value, int if name == "mesh" else str, file=file, field=f"{where}.{name}"))
        fields[name] = value
    fields["outcome"] = _LEGACY.get(fields["outcome"], fields["outcome"])
    if fields["outcome"] not in OUTCOMES:
        raise StoreError(f"not an outcome: {fields['outcome'][:40]!r}", file=file, field=f"{where}.outcome")
    return CallOutcome(**fields)


def load_entry(folder: Path, entry: str, settings: dict) -> tuple[SweepResult, str] | None:
    """(the entry's stored results, the commit they were swept at), or None when there are none or
    they are stale (other settings, a handler that could take its calls changed or appeared) or
    do not check: no regular file (a link, a FIFO, a device: never read), too large or deep,
    a field of the wrong kind. Such an entry is swept again and its file written anew."""
    path = _file(folder, entry)
    file = str(path)
    try:
        document = read_json(path, MAX_JSON_BYTES.value, setting=MAX_JSON_BYTES.env)
        if (document is None or need(document, "settings", dict, file=file) != settings
                or need(document, "entry", str, file=file) != entry):
            return None
        outcomes = [_outcome(o, file, f"outcomes[{i}]")
                    for i, o in enumerate(items(need(document, "outcomes", list, file=file), dict, file=file,
                                                field="outcomes"))]
        depends_on = need(document, "depends_on", dict, file=file)
        defects = items(need(document, "defects", list, file=file, default=[]), str, file=file, field="defects")
        seconds = need(document, "seconds", float, file=file, default=0.0)
        commit = need(document, "commit", str, file=file, default="")
    except StoreError:
        return None
    if _depends_on(outcomes) != depends_on:
        return None
    return SweepResult(outcomes=outcomes, defects=list(defects), seconds=float(seconds)), commit


#: the most a lock file may hold: "PID START" written by :func:`claim_entry`
_LOCK_BYTES = 64


@dataclass(frozen=True)
class LockOwner:
    """Who holds an entry's lock, as its file says: a pid and that process's start time (None
    where the file predates start times or /proc has none), or why the file names no owner."""

    pid: int = 0
    started: int | None = None
    invalid: str = ""        # why the file names no owner (garbage text, not a regular file)

    def alive(self) -> bool:
        return not self.invalid and process_alive(self.pid, self.started)


def _lock(folder: Path, entry: str) -> Path:
    return _file(folder, entry, ".lock")


def lock_owner(folder: Path, entry: str) -> LockOwner | None:
    """The owner an entry's lock file names, or None when there is no lock."""
    lock = _lock(folder, entry)
    if not os.path.lexists(lock):
        return None
    if lock.is_symlink():
        return LockOwner(invalid=f"the lock file {lock} is unreadable (a symbolic link, not followed)")
    try:
        text = read_regular_file(lock, _LOCK_BYTES).decode("ascii")
    except (SpecError, UnicodeDecodeError) as error:
        if not os.path.lexists(lock):    # released while being read
            return None
        return LockOwner(invalid=f"the lock file {lock} is unreadable ({shorten(str(error), 120)})")
    words = text.split()
    if not 1 <= len(words) <= 2 or not all(w.isdigit() and len(w) < 20 for w in words) or int(words[0]) <= 0:
        return LockOwner(invalid=f"the lock file {lock} names no process ({shorten(text, 40)})")
    return LockOwner(int(words[0]), int(words[1]) if len(words) == 2 else None)


def held(folder: Path, entry: str) -> str | None:
    """Why the entry is not free to sweep (a live process sweeping it), or None: a lock whose
    process died (a crash, a kill) or names no process is stale and the next claim takes it over."""
    owner = lock_owner(folder, entry)
    if owner is None or not owner.alive():
        return None
    return f"process {owner.pid} is sweeping it"


def _stale(owner: LockOwner) -> str:
    return (f"{owner.invalid}: treated as stale" if owner.invalid else
            f"process {owner.pid}, which held its lock, is gone (died or killed while sweeping it)")


def claim_entry(folder: Path, entry: str) -> tuple[bool, str]:
    """Claim the entry for this process, so several processes can share one sweep: its lock file
    holds this process's pid and start time. (True, '') when claimed; (True, why) when a stale
    lock (a dead owner's, a pid reused by another process, a file naming no process) was taken
    over; (False, why) when a live process holds it. Claims of a folder go one at a time (an
    flock on its ``.claims`` file), so two processes never both take over one stale lock."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = _lock(folder, entry)
    try:
        guard = os.open(folder / ".claims", os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                        0o600)
    except OSError as error:     # a link or a FIFO planted in its place
        return False, f"cannot take {folder / '.claims'} to claim entries ({error.strerror or error})"
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)
        owner = lock_owner(folder, entry)
        if owner is not None and owner.alive():
            return False, f"process {owner.pid} is sweeping it"
        said = ""
        if owner is not None:
            said = f"took its lock over: {_stale(owner)}"
            if lock.is_dir() and not lock.is_symlink():
                return False, f"{lock} is a folder, not a lock file; remove it to sweep the entry"
            lock.unlink(missing_ok=True)
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return False, "another process has just claimed it"
        with os.fdopen(descriptor, "w") as handle:
            started = process_start(os.getpid())
            handle.write(f"{os.getpid()}" + ("" if started is None else f" {started}"))
        return True, said
    finally:
        os.close(guard)


def release_entry(folder: Path, entry: str) -> None:
    _file(folder, entry, ".lock").unlink(missing_ok=True)
