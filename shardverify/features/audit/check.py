"""The audit as a test: generated ``test_<op>_audit.py`` modules call these, so a spec change
that drops a valid strategy (or a generator that stops offering one) fails CI with the
combinations it lost."""

from __future__ import annotations

import threading
from pathlib import Path

from shardverify.features.audit.run import CaseAudit, audit_case

__all__ = ["audit_generated_case", "assert_complete"]

_LOCK = threading.Lock()
_SPECS: dict = {}
_CASES: dict = {}
_FOLDERS_READ: set = set()


def _spec(root: Path, spec_path: str):
    """The op spec at ``root/spec_path``, read once per process. The first audit of a process
    reads every op spec of the folder together: reading one named spec checks it against the
    whole folder's claims (each spec file opened), so an audit test per spec read the folder
    once per spec. A spec that read does not give (the folder holds an invalid spec: the error
    names that one) is read alone, so an audit fails only for a fault its own spec's read finds."""
    from shardverify.errors import SpecError
    from shardverify.spec.catalogue import load_op_specs

    key = (str(root), spec_path)
    with _LOCK:
        if str(root) not in _FOLDERS_READ:
            _FOLDERS_READ.add(str(root))
            try:
                _SPECS.update(((str(root), spec.source), spec) for spec in load_op_specs(root, None, []))
            except SpecError:
                pass   # each spec read alone below: its own fault said, none of another's
        if key not in _SPECS:
            _SPECS[key] = load_op_specs(root, None, [str(root / spec_path)])[0]
        return _SPECS[key]


def _cases(root: Path, spec_path: str, spec) -> dict:
    """Case id -> (its OpCase, its grid point) of ``spec``, made once per process: a spec's
    audit tests ask for one case each, and making every case of a spec took a few milliseconds
    a test."""
    key = (str(root), spec_path)
    with _LOCK:
        if key not in _CASES:
            _CASES[key] = {cid: (case, dict(case_spec.point))
                           for case_spec, (cid, case) in zip(spec.cases(), spec.op_cases())}
        return _CASES[key]


def audit_generated_case(root: Path | str, spec_path: str, case_id: str, mesh_shape) -> CaseAudit:
    """Audit case ``case_id`` of the spec at ``root/spec_path`` (read from disk, not from the
    generated test, so the test checks the spec as it is there: :func:`_spec`) on ``mesh_shape``."""
    spec = _spec(Path(root), spec_path)
    found = _cases(Path(root), spec_path, spec).get(case_id)
    if found is None:
        raise LookupError(f"{spec_path} has no case {case_id!r}; run `shardverify generate`")
    case, point = found
    return audit_case(spec, case_id, case, tuple(mesh_shape), dict(point))


def assert_complete(result: CaseAudit, show: int = 30) -> None:
    """AssertionError listing the incorrect strategies and the new missing combinations."""
    __tracebackhide__ = True
    if not result.failed:
        return
    lines = [f"audit of {result.op} {result.case} on mesh {list(result.mesh)}: {len(result.incorrect)} incorrect, "
             f"{len(result.missing)} missing outside the spec's `audit: accept:` list"]
    if result.error:
        lines.append(f"  error: {result.error}")
    for finding in (result.incorrect + result.missing)[:show]:
        lines.append(f"  {finding.kind}: {finding.line}")
    extra = len(result.incorrect) + len(result.missing) - show
    if extra > 0:
        lines.append(f"  ... {extra} more: shardverify audit {result.op} --mesh {','.join(map(str, result.mesh))}")
    raise AssertionError("\n".join(lines))
