"""Every exception shardverify raises, so callers can catch by kind and messages stay uniform."""

from __future__ import annotations


class ShardVerifyError(Exception):
    """Base class of all shardverify errors."""


class InvalidArgument(ShardVerifyError, ValueError):
    """An argument was rejected eagerly; the message names the value and what was expected."""


class MeshError(InvalidArgument):
    """An impossible device mesh (bad shape, ids, axes)."""


class ShardingSpecError(InvalidArgument):
    """A tensor layout that cannot exist on the given tensor and mesh."""


class DuplicateMeshAxisError(ShardingSpecError):
    """A mesh axis shards two tensor dims (or one dim twice)."""


class DimOutOfRangeError(ShardingSpecError):
    """A tensor dim outside the tensor's rank."""


class MeshAxisOutOfRangeError(ShardingSpecError):
    """A mesh axis outside the mesh's rank."""


class SequenceParseError(ShardingSpecError):
    """A sharding sequence string such as "[R, S0]" that does not parse."""


class StrategyError(ShardVerifyError):
    """A strategy or strategy generator is inconsistent."""


class HandlerError(ShardVerifyError):
    """No handler, or a handler that cannot read the node it was given."""


class SpecError(ShardVerifyError):
    """A malformed YAML spec; carries the file, line and field."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        self.file, self.line, self.field, self.reason = file, line, field, message
        super().__init__(f"{spec_location(file, line, field)}: {message}")


#: the most characters of one value an error message echoes (a data list of a million numbers,
#: a megabyte of text: the message names it and shows its start)
ECHO_CHARS = 80


def shorten(value: object, limit: int = ECHO_CHARS) -> str:
    """``value`` as an error message shows it: its repr, cut to about ``limit`` characters with
    how long it was. A long list, tuple or string is cut before it is written out, so a value of
    a million items costs a few of them."""
    if isinstance(value, (list, tuple)) and len(value) > limit // 2:
        return f"{repr(type(value)(value[:limit // 2]))[:limit]}... ({len(value)} items)"
    if isinstance(value, str) and len(value) > limit:
        return f"{repr(value[:limit])}... ({len(value)} characters)"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def spec_location(file: str | None, line: int | None = None, field: str | None = None) -> str:
    """``file:line: field 'x'``, as a SpecError names a place in a spec."""
    where = file or "<spec>"
    if line is not None:
        where += f":{line}"
    if field:
        where += f": field '{field}'"
    return where


class StoreError(SpecError):
    """A stored file (results, a confirmation, a cached verdict, an OpInfo entry) that cannot be
    used: the file and the field that is wrong."""


class CollectiveError(ShardVerifyError):
    """A collective called with inconsistent arguments across ranks or impossible shapes."""


class BackendError(ShardVerifyError):
    """A rank failed while running an SPMD function."""


class RankError(BackendError):
    """A rank raised; carries the rank and its formatted traceback."""

    def __init__(self, rank: int, message: str, traceback_text: str = "") -> None:
        self.rank, self.ranks, self.traceback_text = rank, (rank,), traceback_text
        super().__init__(f"rank {rank} raised: {message}")


class RankTimeout(BackendError):
    """Ranks did not finish within the timeout (a hang or a deadlock)."""

    def __init__(self, ranks: tuple[int, ...], timeout: float, what: str = "", *,
                 never_entered: tuple[int, ...] = (), detail: str = "") -> None:
        self.ranks, self.rank, self.timeout = tuple(ranks), (ranks[0] if ranks else -1), timeout
        self.never_entered = tuple(never_entered)   # ranks that skipped the collective the others wait in
        suffix = f" while running {what}" if what else ""
        detail = f": {detail}" if detail else ""
        super().__init__(f"rank(s) {list(ranks)} did not finish within {timeout:g}s{suffix}{detail}")


class RankDied(BackendError):
    """A rank's process exited unexpectedly."""

    def __init__(self, rank: int, exitcode: int | None, what: str = "") -> None:
        self.rank, self.ranks, self.exitcode = rank, (rank,), exitcode
        suffix = f" while running {what}" if what else ""
        super().__init__(f"rank {rank} died (exit code {exitcode}){suffix}")


class VerificationError(ShardVerifyError):
    """A strategy's numbers or communication differ from the single-device reference."""
