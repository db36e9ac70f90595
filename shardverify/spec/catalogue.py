"""The spec catalogue: which spec files there are (every registered kind's folder), which of
them a command names, and each parsed and checked against the others.

Every feature that reads specs (verify, audit, dtensor, explore, list, coverage, generate)
reads them here; `shardverify.codegen` only renders what this returns. The op kind is
registered on import; the CLI registers every other kind (`shardverify.cli.catalogue`).
A spec that vanished from the run, a symbolic link or a misnamed file is an error, never
skipped: its generated files would pass unchecked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from shardverify.errors import SpecError
from shardverify.spec.claims import read_claim
from shardverify.spec.conflicts import conflicts, rivals
from shardverify.spec.kinds import SpecKind, register_spec_kind, spec_kinds
from shardverify.spec.limits import check_settings
from shardverify.spec.loader import load_yaml
from shardverify.spec.op_kind import OP_KIND
from shardverify.spec.trust import check_trusted_setting

__all__ = ["SpecSource", "InvalidSpecs", "SPEC_PATH", "discover_specs", "select_specs", "load_specs",
           "spec_sources", "spec_folder_sources", "spec_folders", "load_op_specs"]

_SPEC_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,95}\.yaml\Z")
#: what a spec path may hold: it is written into every generated file's header
SPEC_PATH = re.compile(r"[A-Za-z0-9_./-]{1,400}\Z")

register_spec_kind(OP_KIND)


class InvalidSpecs(SpecError):
    """One or more specs are invalid; `errors` holds each spec's SpecError."""

    def __init__(self, errors: list[SpecError]) -> None:
        self.errors = list(errors)
        first = self.errors[0]
        super().__init__(first.reason, file=first.file, line=first.line, field=first.field)
        self.args = ("\n".join(str(e) for e in self.errors),)

    def __str__(self) -> str:
        return self.args[0]


@dataclass(frozen=True)
class SpecSource:
    """A spec file: its kind, its path on disk and the name used in messages and headers."""

    kind: SpecKind
    path: Path
    display: str


def _display(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def _display_link(path: Path, root: Path) -> str:
    """A path for messages that does not follow the link itself (it may dangle or loop)."""
    try:
        return (path.parent.resolve() / path.name).relative_to(root.resolve()).as_posix()
    except (ValueError, OSError, RuntimeError):
        return path.as_posix()


def discover_specs(specs_dir: Path, root: Path, kinds: tuple[SpecKind, ...]) -> list[SpecSource]:
    """Every spec file, kind by kind: `<specs_dir>/<kind.subdir>/*.yaml`, sorted by name.
    A symbolic link or a non-file named *.yaml is an error, never silently skipped: a spec
    that vanished from the run would let its generated files pass unchecked."""
    sources, errors = [], []
    for kind in kinds:
        folder = specs_dir / kind.subdir if kind.subdir else specs_dir
        if folder.is_symlink():
            errors.append(SpecError("the spec folder is a symbolic link; specs must live in the "
                                    "checkout", file=_display(folder, root)))
            continue
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if path.suffix not in (".yaml", ".yml"):
                continue
            if path.is_symlink():
                state = "dangling " if not path.exists() else ""
                errors.append(SpecError(f"the spec is a {state}symbolic link; specs must be regular "
                                        "files (copy it instead)", file=_display_link(path, root)))
            elif not path.is_file():
                errors.append(SpecError("named like a spec but not a regular file",
                                        file=_display_link(path, root)))
            else:
                sources.append(SpecSource(kind, path, _display(path, root)))
    if errors:
        raise InvalidSpecs(errors)
    return sources


def select_specs(sources: list[SpecSource], names: list[str]) -> list[SpecSource]:
    """The sources named on the command line, by path or by file stem ("sum")."""
    chosen: list[SpecSource] = []
    for name in names:
        wanted = Path(name)
        match = [s for s in sources
                 if (wanted.exists() and s.path.resolve() == wanted.resolve()) or s.path.stem == name
                 or s.display == name]
        if not match:
            known = ", ".join(s.display for s in sources) or "none"
            raise SpecError(f"no spec named {name!r}; specs: {known}")
        if len(match) > 1:
            raise SpecError(f"{name!r} names several specs: {', '.join(s.display for s in match)}; give the path")
        if match[0] not in chosen:
            chosen.append(match[0])
    return chosen


def load_specs(sources: list[SpecSource], context: list[SpecSource] | None = None) -> list[tuple[SpecSource, object]]:
    """Parse every source; raises InvalidSpecs listing every invalid spec. Specs are also
    checked against each other (one name per kind, one spec per op target), including the
    specs of ``context`` (the whole folder, when only some are named) that parse. Of those, only
    the specs whose claim (name and targets, `spec.claims`) may conflict are parsed: the named
    specs' checks read one spec each, not the folder."""
    parsed, errors = _parse_all(sources)
    if context is not None:
        chosen = {source.path for source in sources}
        rest = [s for s in context if s.path not in chosen] if parsed else []
        claims = [(s, read_claim(s.path, s.display, s.kind.name_key)) for s in rest]
        others, _ = _parse_all(rivals(parsed, claims))
        errors += conflicts(parsed, others)
    else:
        errors += conflicts(parsed, [])
    if errors:
        raise InvalidSpecs(errors)
    return parsed


def _parse_all(sources: list[SpecSource]) -> tuple[list[tuple[SpecSource, object]], list[SpecError]]:
    parsed, errors = [], []
    try:
        check_settings()   # a bad limit setting: one error naming it, not one per spec
        check_trusted_setting()   # alike the trusted targets' setting
    except SpecError as exc:
        return [], [exc]
    for source in sources:
        try:
            if not _SPEC_NAME.match(source.path.name):
                raise SpecError("spec file names use letters, digits, '_', '.', '-' (at most 100 "
                                "characters) and end in .yaml", file=repr(source.display[:120]))
            if not SPEC_PATH.match(source.display):
                raise SpecError("the spec path (written into generated headers) may only use letters, "
                                "digits, '_', '.', '-' and '/'", file=repr(source.display[:120]))
            parsed.append((source, source.kind.parse(load_yaml(source.path, display=source.display))))
        except SpecError as exc:
            errors.append(exc)
        except RecursionError:
            errors.append(SpecError("the spec nests too deeply", file=source.display))
    return parsed, errors


def spec_sources(root: Path, specs_dir: Path | None = None, names: list[str] | None = None) -> list[SpecSource]:
    """The spec files under `specs_dir` (default ROOT/specs) of every kind, or the named ones.
    A missing folder, or one holding no spec at all, is an error: a mistyped --specs-dir must
    never look like "every spec was deleted"."""
    folder = spec_folder_sources(root, specs_dir)
    return select_specs(folder, names) if names else folder


def spec_folder_sources(root: Path, specs_dir: Path | None = None) -> list[SpecSource]:
    """Every spec of the folder (the context named specs are checked against)."""
    specs_dir = _specs_dir(root, specs_dir)
    sources = discover_specs(specs_dir, root, spec_kinds())
    if not sources:
        raise SpecError("no spec files (*.yaml) in this folder; nothing to read, so nothing is "
                        "written or removed (pass --specs-dir or --root)", file=str(specs_dir))
    return sources


def _specs_dir(root: Path, specs_dir: Path | None) -> Path:
    specs_dir = specs_dir if specs_dir is not None else root / "specs"
    if specs_dir.is_symlink():
        raise SpecError("the spec folder is a symbolic link; pass the real folder", file=str(specs_dir))
    if not specs_dir.is_dir():
        raise SpecError("no spec folder at this path; pass --specs-dir or --root", file=str(specs_dir))
    return specs_dir


def spec_folders(root: Path, specs_dir: Path | None = None) -> tuple[Path, ...]:
    """The folder of every registered kind (where a spec that is gone leaves orphans)."""
    base = _specs_dir(root, specs_dir)
    return tuple(base / kind.subdir if kind.subdir else base for kind in spec_kinds())


def load_op_specs(root: Path, specs_dir: Path | None, names: list[str]) -> list:
    """The parsed op specs (all, or the named ones); SpecError on a missing or invalid spec."""
    folder = spec_folder_sources(root, specs_dir)
    sources = select_specs(folder, names) if names else folder
    if names:
        others = [s.display for s in sources if s.kind.name != "op"]
        if others:
            raise SpecError(f"`shardverify verify` checks op specs; {', '.join(others)} "
                            f"is a {sources[0].kind.name if len(others) == 1 else 'non-op'} spec")
    else:
        sources = [s for s in sources if s.kind.name == "op"]
    # the named specs are checked against the folder's other op specs (one name per kind, one
    # spec per op target): specs of other kinds cannot conflict with them, and parsing those
    # (plans are solved, models dry-run) would cost seconds per call
    others = [s for s in folder if s.kind.name == "op"] if names else None
    return [spec for _, spec in load_specs(sources, context=others)]
