"""Each silent-corruption (and late-failure) class confirmed on real gloo processes: the class's
repro script (:mod:`shardverify.features.dtensor.repro`) run under ``torchrun``, one process per rank.

The in-process execution runs every rank under ``LocalTensorMode`` on a fake process group; a
finding there is only as sound as that simulation. Here the same script runs on N real gloo
processes (N the mesh's size), each process prints a ``VERDICT {json}`` line, and the class is:

* ``confirmed``: a rank reproduced the class's failure (wrong values, or the late failure); a
  late failure also where the op returned on every rank and a process was then killed inside
  ``full_tensor()``'s or the backward's collectives (gloo aborts a process whose rank receives
  more bytes than its buffer holds: DTensor handed one collective blocks of different sizes);
* ``not reproduced``: every rank right on real processes: the in-process finding is suspect;
* ``differs``: DTensor failed otherwise on real processes (the op raised, another failure, or a
  process killed inside DTensor: each said with the step it died in);
* ``aborted``: a process was killed by a signal (SIGABRT, SIGSEGV) or ended without a verdict
  outside DTensor's steps (before the op ran: the script's own setup);
* ``timeout``: no result within the time allowed (a hang; every process is then killed);
* ``error``: no script could be made or run (said why).

Confirmations are stored beside the results (``DIR/torch-VERSION/gloo/``, one file per class
key) with the example they ran (op, case, mesh, layouts, the spec file's hash, the script
format), and are not run again while the class's example is the same. A stored confirmation is
read through :mod:`shardverify.stored` and checked field by field; one that does not check (no
regular file, a wrong field) is left out, and run again with ``--confirm``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shardverify.features.dtensor.repro import FORMAT, RUNNER, STAGE, VERDICT
from shardverify.stored import StoreError, need, read_json, write_json

__all__ = ["Confirmation", "STATUSES", "EXPECTED", "LATE_STAGES", "example_of", "class_examples", "confirm_classes",
           "load_confirmations", "save_confirmation",
           "run_on_gloo", "decide", "stages_of", "DEFAULT_TIMEOUT"]

STORE_VERSION = 1
DEFAULT_TIMEOUT = 300.0      # seconds per class: torchrun's start, N processes importing torch, the op
MAX_CONFIRMATION_BYTES = 1 << 20   # a stored confirmation: its example, detail and the end of the output

STATUSES: dict[str, str] = {
    "confirmed": "reproduced on real gloo processes",
    "not reproduced": "right on every real gloo process: the in-process finding is suspect",
    "differs": "DTensor fails otherwise on real gloo processes",
    "aborted": "a process was killed by a signal or ended without a verdict before DTensor ran",
    "timeout": "no result within the time allowed",
    "error": "the repro could not be made or run",
}

#: the verdict a repro prints when it reproduces each class
EXPECTED = {"silent-wrong": "wrong", "late-failure": "late-failure"}


@dataclass(frozen=True)
class Confirmation:
    """One class's repro run on ``world`` real gloo processes."""

    key: str
    klass: str
    torch: str
    example: dict          # what ran: op, case, mesh, layouts, spec_hash, format
    status: str            # a key of STATUSES
    detail: str
    world: int
    seconds: float
    script_sha: str        # the sha256 of the script that ran (first 12 hex digits)
    output: str = ""       # the end of what torchrun printed

    def to_json(self) -> dict:
        return {"version": STORE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, item: dict, file: str = "<confirmation>") -> "Confirmation":
        """The confirmation ``item`` holds, checked field by field (StoreError naming ``file`` and the field)."""
        if need(item, "version", int, file=file) != STORE_VERSION:
            raise StoreError(f"confirmation version {item['version']}, this shardverify reads {STORE_VERSION}",
                             file=file, field="version")
        fields = {name: need(item, name, kind, file=file) for name, kind in _FIELDS}
        if fields["status"] not in STATUSES:
            raise StoreError(f"not a status: {fields['status'][:40]!r}", file=file, field="status")
        if fields["klass"] not in EXPECTED:
            raise StoreError(f"not a class confirmed on gloo: {fields['klass'][:40]!r}", file=file, field="klass")
        return cls(**fields, output=need(item, "output", str, file=file, default=""))


#: a stored confirmation's fields and their kinds
_FIELDS = (("key", str), ("klass", str), ("torch", str), ("example", dict), ("status", str), ("detail", str),
           ("world", int), ("seconds", float), ("script_sha", str))


def example_of(finding, spec_hash: str) -> dict:
    """What identifies the run of a class's example: a stored confirmation of another is stale."""
    return {"op": finding.op, "case": finding.case, "mesh": list(finding.mesh),
            "layouts": dict(finding.layouts), "spec_hash": spec_hash, "format": FORMAT}


def _path(folder: Path, torch_version: str, key: str, mesh=None) -> Path:
    """The class's file; with ``mesh``, its file for that mesh (a class key is the same on every
    mesh: one file per key let a run on one mesh overwrite another mesh's confirmation)."""
    name = "".join(c if c.isalnum() else "_" for c in key).strip("_")[:100]
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]     # keys differing only in punctuation
    where = "" if mesh is None else "." + "x".join(str(int(m)) for m in mesh)
    return folder / f"torch-{torch_version}" / "gloo" / f"{name}.{digest}{where}.json"


def load_confirmations(folder: Path, torch_version: str, examples: dict[str, dict]) -> dict[str, Confirmation]:
    """The stored confirmation of each class in ``examples`` (key -> :func:`example_of`) that ran
    that very example on this torch (its mesh's file, else the key's file of a store made before
    files were per mesh); a file that does not check (no regular file, too large or deep, a field
    of the wrong kind) is left out, as if absent: it runs again."""
    found = {}
    for key, example in examples.items():
        for path in (_path(folder, torch_version, key, example.get("mesh")), _path(folder, torch_version, key)):
            try:
                document = read_json(path, MAX_CONFIRMATION_BYTES)
                if document is None:
                    continue
                stored = Confirmation.from_json(document, str(path))
            except StoreError:
                continue
            if stored.key == key and stored.example == example:
                found[key] = stored
                break
    return found


def save_confirmation(folder: Path, confirmation: Confirmation) -> None:
    """Written whole or not at all, in its mesh's file."""
    write_json(_path(folder, confirmation.torch, confirmation.key, confirmation.example.get("mesh")),
               confirmation.to_json())


def run_on_gloo(case: dict, world: int, timeout: float | None, *, program: str | None = None) -> tuple[str, bool, float]:
    """(what torchrun printed, whether it timed out, seconds) of the repro program
    (:data:`~shardverify.features.dtensor.repro.RUNNER`, or the source ``program``) run on the repro
    ``case`` written as JSON, on ``world`` gloo processes: ``torchrun --standalone`` (a free port:
    runs beside others), in a temporary folder that is also every process's temporary folder
    (torchrun's ``torchelastic_*`` folders go with it), in a session of its own that is killed
    whole on timeout (no process outlives it)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardverify-gloo-") as folder:
        path = Path(folder) / "repro.py"
        path.write_text(RUNNER.read_text(encoding="utf-8") if program is None else program)
        (Path(folder) / "case.json").write_text(json.dumps(case, separators=(",", ":")))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": folder}
        env.pop("PYTHONPATH", None)       # torch alone: nothing of shardverify is importable
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node", str(world), str(path), "case.json"], cwd=folder, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            output = _stop(proc)
        except BaseException:     # Ctrl-C: the processes of the class in progress end with this one
            _stop(proc)
            raise
    return output or "", timed_out, time.perf_counter() - start


def _stop(proc: subprocess.Popen) -> str:
    """Ends torchrun and every process it started (its session), TERM then KILL."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            output, _ = proc.communicate(timeout=wait)
            return output
        except subprocess.TimeoutExpired:
            continue
    return ""


_EXIT = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def verdicts_of(output: str) -> dict[int, tuple[str, str]]:
    """rank -> (status, detail) from the ``VERDICT`` lines of every process."""
    return _tagged(output, VERDICT, lambda item: (str(item["status"]), str(item.get("detail") or "")))


def signals_of(output: str) -> dict[int, str]:
    """rank -> the signal that killed it, from torchrun's failure summary; torchrun's own SIGTERM
    to the other ranks once one has failed is not counted."""
    found = {}
    for rank, code in _EXIT.findall(output):
        code = int(code)
        if code < 0 and -code != signal.SIGTERM:
            try:
                found[int(rank)] = signal.Signals(-code).name
            except ValueError:
                found[int(rank)] = f"signal {-code}"
    return found


def stages_of(output: str) -> dict[int, str]:
    """rank -> the last step its process said it was starting (``STAGE`` lines)."""
    return _tagged(output, STAGE, lambda item: str(item["stage"]))


def _tagged(output: str, tag: str, value) -> dict:
    """rank -> ``value(item)`` of the last ``tag`` + a JSON object naming its "ranks" (one that
    does not parse is skipped). Read wherever the tag stands in a line: the processes write
    unbuffered, where ``print`` writes its text and its newline apart, so another process's line
    can land before the newline ("VERDICT {..}VERDICT {..}"); the text itself is one write, whole."""
    found: dict = {}
    decoder = json.JSONDecoder()
    for line in output.splitlines():
        at = line.find(tag)
        while at >= 0:
            try:
                item, _ = decoder.raw_decode(line, at + len(tag))
                for rank in item["ranks"]:
                    found[int(rank)] = value(item)
            except (ValueError, KeyError, TypeError):
                pass
            at = line.find(tag, at + len(tag))
    return found


#: the steps after the op returned: a process killed in one of them failed late
LATE_STAGES = ("full_tensor() of the output", "the backward")


def decide(klass: str, output: str, world: int, timed_out: bool, timeout: float) -> tuple[str, str]:
    """(status, detail) of a class's run from what torchrun printed. A process killed by a signal
    in one of DTensor's steps (its last ``STAGE``) is DTensor's failure, said with the step and
    gloo's reason: after the op returned it is a late failure; only a process killed outside them
    (or ending without a word) is ``aborted``. A process killed after its verdict is judged by it."""
    verdicts, stages = verdicts_of(output), stages_of(output)
    # a rank that printed its verdict had finished DTensor's steps: a signal after it (gloo's
    # teardown aborting at exit) changes nothing it computed
    killed = {r: name for r, name in signals_of(output).items() if r not in verdicts}
    missing = [r for r in range(world) if r not in verdicts]
    hits = {r: d for r, (s, d) in sorted(verdicts.items()) if s == EXPECTED[klass]}
    died_in = {r: stages.get(r, "") for r in killed}
    inside = bool(killed) and all(died_in.values())
    late = inside and all(stage in LATE_STAGES for stage in died_in.values())
    aborts = (", ".join(f"rank {r} killed by {killed[r]} in {died_in[r]}" for r in sorted(killed)) if inside else
              ", ".join(f"rank {r} killed by {name}" for r, name in sorted(killed.items())))
    if inside:
        gloo = _gloo_error(output)
        said = "; ".join(f"rank {r} {s}" + (f": {d[:150]}" if d else "") for r, (s, d) in sorted(verdicts.items()))
        aborts = "; ".join(part for part in (aborts, f"gloo: {gloo}" if gloo else "", said) if part)
        if late:
            aborts = f"the op returned on every rank, then {aborts}"
        if late and klass == "late-failure":
            return "confirmed", aborts
    if hits and not inside:
        # a rank's own error before another's lost connection to it (gloo's "Connection closed by peer")
        first = min(hits.values(), key=lambda d: "gloo/transport" in d or "Connection closed" in d)
        detail = f"{first} ({len(hits)} of {world} ranks)"
        return "confirmed", detail + (f"; {aborts}" if aborts else "")
    if timed_out:
        return "timeout", (f"no result within {timeout:g} s; every process killed"
                           + (f"; ranks without a verdict: {missing}" if missing else ""))
    if inside:
        return "differs", (f"killed after the op returned: {aborts}" if late else f"the op itself kills a process: {aborts}")
    if killed or missing:
        last = _last_error(output)
        return "aborted", "; ".join(part for part in (aborts, f"ranks without a verdict: {missing}" if missing else "",
                                                      last) if part)
    if all(s == "right" for s, _ in verdicts.values()):
        return "not reproduced", f"every one of the {world} ranks computes the right values and gradients"
    if all(s == "error" for s, _ in verdicts.values()):
        return "error", verdicts[0][1]
    status, detail = next((s, d) for s, d in verdicts.values() if s != "right")
    return "differs", f"{status} on real processes: {detail}"


def _gloo_error(output: str) -> str:
    """What gloo said when it aborted a process (its ``what():`` line), or ""."""
    for line in output.splitlines():
        if "what():" in line:
            return line.split("what():", 1)[1].strip()[:300]
    return ""


def _last_error(output: str) -> str:
    """The last line that looks like an error (a traceback's end), for a run without verdicts."""
    for line in reversed(output.splitlines()):
        text = line.strip()
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", text) and "ChildFailedError" not in text:   # torchrun's own
            return text[:300]
    return ""


def _kept(output: str, status: str) -> str:
    """What is stored of a run's output (the folder is committed): the verdicts the processes
    printed and gloo's reason for killing one, and unless confirmed without a process killed the
    end of the rest (torchrun's summary of who exited how)."""
    said = [line for line in output.splitlines() if line.startswith(("verdict ", "DTensor output")) or "what():" in line]
    whole = status == "confirmed" and not signals_of(output)
    return "\n".join(said)[-1500:] + ("" if whole else "\n...\n" + output[-1500:])


def script_sha(case: dict) -> str:
    """The sha256 (first 12 hex digits) of what ran: the repro program and its case."""
    text = RUNNER.read_text(encoding="utf-8") + json.dumps(case, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def class_examples(results, specs, root: Path = Path("."), klasses=tuple(EXPECTED)) -> dict[str, tuple]:
    """key -> (the class's first finding, :func:`example_of` it) of every class in ``klasses``: the
    example the report shows is the one run. A finding of a spec not in ``specs`` (a custom op) is
    left out: its repro cannot be made again from what is stored."""
    from shardverify.features.dtensor.store import spec_hash

    by_name = {spec.name: spec for spec in specs}
    hashes: dict[str, str] = {}
    found: dict[str, tuple] = {}
    for r in results:
        for f in r.findings:
            if f.klass not in klasses or f.key() in found or f.op not in by_name:
                continue
            if f.op not in hashes:
                hashes[f.op] = spec_hash(by_name[f.op], root)
            found[f.key()] = (f, example_of(f, hashes[f.op]))
    return found


def confirm_classes(results, specs, folder: Path, *, root: Path = Path("."), klasses=("silent-wrong",),
                    timeout: float | None = DEFAULT_TIMEOUT, progress=None) -> dict[str, Confirmation]:
    """Every class of ``klasses`` confirmed on gloo: a stored confirmation of the same example is
    kept, every other class's repro is made again from its spec and run under torchrun, and
    stored in ``folder`` as soon as it ran. ``progress(confirmation, reused)`` after each class."""
    import torch

    from shardverify.features.dtensor.run import rebuild_case

    by_name = {spec.name: spec for spec in specs}
    examples = class_examples(results, specs, root, klasses)
    stored = load_confirmations(folder, torch.__version__, {k: e for k, (_, e) in examples.items()})
    done: dict[str, Confirmation] = {}
    for key, (finding, example) in examples.items():
        if key in stored:
            done[key] = stored[key]
            if progress is not None:
                progress(stored[key], True)
            continue
        try:   # made again from the spec: nothing of a stored finding but its combination is used
            case = rebuild_case(by_name[finding.op], finding)
        except Exception as exc:  # noqa: BLE001 - said as the class's error, the others still run
            case = f"{type(exc).__name__}: {exc}"
        if isinstance(case, str):
            world = math.prod(m for m in finding.mesh if type(m) is int) if isinstance(finding.mesh, tuple) else 0
            status, detail, output, seconds, sha = "error", f"no repro: {case}".splitlines()[0][:300], "", 0.0, ""
        else:
            world = math.prod(case["mesh"])
            output, timed_out, seconds = run_on_gloo(case, world, timeout)
            status, detail = decide(finding.klass, output, world, timed_out, timeout)
            if "killed by" in detail and finding.rule:   # who handed gloo the mismatched buffers
                detail += f"; in process, DTensor's rule against its runtime: {finding.rule}"
            sha = script_sha(case)
        found = Confirmation(key, finding.klass, torch.__version__, example, status, detail, world,
                             round(seconds, 1), sha, _kept(output, status))
        save_confirmation(folder, found)
        done[key] = found
        if progress is not None:
            progress(found, False)
    return done
