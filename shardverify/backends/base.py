"""What every backend and every communicator promise, plus the checks they share.

A check is an SPMD function ``fn(comm, *args)`` run once per rank.  The communicator
gives it raw (non-differentiable) collectives over mesh axes; the backend runs it on
every rank and returns the per-rank results.  Argument validation, collective counting
and the group-of-one shortcut live here once, so the simulated and the real
``torch.distributed`` transports only move bytes.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import traceback
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

import torch

from shardverify.errors import BackendError, CollectiveError, RankError
from shardverify.sharding.mesh import DeviceMesh

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

Axes = tuple[int, ...]

#: reduction names accepted by ``all_reduce`` and ``reduce_scatter``
REDUCE_OPS = ("sum", "max", "min")
#: the ``kind`` half of every ``Communicator.counts`` key
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")


@runtime_checkable
class Communicator(Protocol):
    """One rank's view of the mesh: raw collectives, each returning fresh tensors."""

    mesh: DeviceMesh
    rank: int
    device: torch.device
    counts: collections.defaultdict   # (kind, axes) -> number issued

    def all_reduce(self, t: torch.Tensor, axes: Sequence[int], op: str = "sum") -> torch.Tensor: ...
    def all_gather(self, t: torch.Tensor, axes: Sequence[int]) -> list[torch.Tensor]: ...
    def reduce_scatter(self, chunks: Sequence[torch.Tensor], axes: Sequence[int], op: str = "sum") -> torch.Tensor: ...
    def all_to_all(self, chunks: Sequence[torch.Tensor], axes: Sequence[int]) -> list[torch.Tensor]: ...
    def broadcast(self, t: torch.Tensor, axes: Sequence[int], src: int) -> torch.Tensor: ...
    def send(self, t: torch.Tensor, dst: int) -> None: ...
    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor: ...
    def barrier(self, axes: Sequence[int] | None = None) -> None: ...
    def process_group(self, axes: Sequence[int]) -> ProcessGroup | None: ...


@runtime_checkable
class Backend(Protocol):
    """Runs an SPMD function on every rank of ``mesh``; results are indexed by rank."""

    mesh: DeviceMesh

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]: ...
    def close(self) -> None: ...


class ClosingBackend:
    """A backend used as ``with backend:`` is closed when the block ends, however it ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BatchBackend(ClosingBackend):
    """A backend whose ``run`` is one item of its ``run_batch`` (the simulated and the process pool)."""

    def run_batch(self, fn: Callable[..., Any], items: Sequence[tuple], *,
                  timeout: float | None = None) -> list[list[Any] | BackendError]:
        raise NotImplementedError

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """``fn(comm, *args)`` on every rank; the list of return values, indexed by rank."""
        outcome = self.run_batch(fn, [args], timeout=timeout)[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


@dataclass(frozen=True)
class RankResult:
    """The outcome of one rank: its return value, or the exception it raised."""

    rank: int
    ok: bool
    value: Any = None
    message: str = ""
    traceback_text: str = ""

    @classmethod
    def failure(cls, rank: int, exc: BaseException) -> RankResult:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank, False, None, f"{type(exc).__name__}: {exc}", text)

    def error(self) -> RankError:
        return RankError(self.rank, self.message, self.traceback_text)


#: objects already found deeply immutable, by id (kept alive here so an id is never reused).
#: Strategies share layouts and operands across cases: 65,536 entries (5 MB in `verify`) halve
#: the objects walked there, 4,096 kept emptying before the sharing paid
_FROZEN: dict[int, object] = {}
_FROZEN_LIMIT = 65536
_ATOMS = (type(None), bool, int, float, complex, str, bytes, range, torch.dtype, torch.device, enum.Enum,
          type, types.FunctionType, types.BuiltinFunctionType)


#: the atoms a walk meets most (checked by exact type before calling is_frozen on a part)
_SCALARS = frozenset({int, str, float, bool, type(None)})


def is_frozen(value: object) -> bool:
    """Whether ``value`` can never change: scalars, strings, dtypes, enums, functions, and tuples,
    frozensets and frozen dataclasses made only of such values.  Ranks may share these
    instead of each deep-copying them (the bulk of a check's arguments: case, strategy)."""
    if isinstance(value, _ATOMS) or id(value) in _FROZEN:
        return True
    if isinstance(value, (tuple, frozenset)):
        if getattr(value, "__dict__", None):   # a tuple subclass carrying mutable attributes
            return False
        parts: Iterable[object] = value
    else:
        names = _frozen_fields(type(value))
        if names is None:
            return False
        attrs = getattr(value, "__dict__", None)
        if attrs is None:   # slots
            parts = [getattr(value, n) for n in names]
        else:   # every field, and any attribute set besides them
            parts = list(attrs.values()) + [getattr(value, n) for n in names if n not in attrs]
    for part in parts:
        if type(part) not in _SCALARS and not is_frozen(part):
            return False
    if len(_FROZEN) >= _FROZEN_LIMIT:
        _FROZEN.clear()
    _FROZEN[id(value)] = value
    return True


_FIELDS: dict[type, tuple[str, ...] | None] = {}


def _frozen_fields(cls: type) -> tuple[str, ...] | None:
    """The field names of a frozen dataclass type, None for any other type (remembered: a new
    strategy's walk asks it of a hundred objects of a few types)."""
    try:
        return _FIELDS[cls]
    except KeyError:
        pass
    frozen = dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls)) if frozen else None
    return names


def private_copy(args: tuple) -> tuple:
    """What one rank gets of a run's arguments: frozen values shared, everything else deep-copied,
    as if the arguments had crossed into another process. An argument whose class declares
    ``ranks_only_read = True`` is shared too: the class promises that rank code never changes it
    (a whole model's recipe, which each rank copies before running: a deep copy per rank would
    hold a model per rank, and defeat the reference the ranks of one process share)."""
    shared = [is_frozen(a) or getattr(a, "ranks_only_read", False) for a in args]
    if all(shared):
        return args
    return tuple(a if keep else copy.deepcopy(a) for a, keep in zip(args, shared))


def check_timeout(timeout: float | None, default: float) -> float:
    """The effective timeout: ``default`` when None, else a positive number."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise BackendError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def check_fn(fn: object) -> None:
    if not callable(fn):
        raise BackendError(f"run() needs a callable fn(comm, *args), got {fn!r}")


def describe(t: torch.Tensor) -> str:
    """Short metadata text, e.g. ``float32[4, 8]``; equal texts mean compatible tensors."""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def disagreement(what: str, descriptions: dict[int, str]) -> CollectiveError:
    """The error every rank of a group raises when their calls do not match."""
    lines = "\n".join(f"  rank {r}: {d}" for r, d in sorted(descriptions.items()))
    return CollectiveError(f"ranks disagree on {what}; each rank called:\n{lines}")


def p2p_mismatch(src: int, dst: int, sent: str, expected: str) -> CollectiveError:
    """The error both ends of a mismatched send/recv raise."""
    return CollectiveError(f"send from rank {src} to rank {dst} does not match the receive: "
                           f"rank {src} sent {sent}, rank {dst} expects {expected}")


class CommunicatorBase:
    """Validation, counting and the group-of-one shortcut shared by every transport.

    Subclasses implement the ``_``-prefixed transport methods; they receive validated
    arguments, the group in mesh order and a description of this rank's call that all
    ranks of the group must agree on (compared before any payload moves).
    """

    def __init__(self, mesh: DeviceMesh, rank: int, device: torch.device | str) -> None:
        self.mesh = mesh
        self.rank = rank
        self.device = device if isinstance(device, torch.device) else torch.device(device)
        #: (kind, axes) -> number issued (default dicts, not Counters: the simulated mesh makes a
        #: communicator per rank of every check, and a Counter costs several times as much to make)
        self.counts: collections.defaultdict = collections.defaultdict(int)
        #: (kind, axes, payload bytes) -> number issued; the bytes this rank passed in, which
        #: ``DeviceMesh.collective_cost`` prices (the verifier checks declared costs with it)
        self.traffic: collections.defaultdict = collections.defaultdict(int)

    # ---- public collectives -------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, axes: Sequence[int], op: str = "sum") -> torch.Tensor:
        """Elementwise ``op`` (sum|max|min) over the group; a new tensor on every rank."""
        axes, group = self._begin("all_reduce", axes)
        _check_tensor(t, "all_reduce")
        _check_op(op, "all_reduce")
        self.traffic[("all_reduce", axes, _nbytes(t))] += 1
        if len(group) == 1:
            return _fresh(t)
        return self._all_reduce(t, group, op, f"all_reduce(op={op}) over axes {axes}: {describe(t)}")

    def all_gather(self, t: torch.Tensor, axes: Sequence[int]) -> list[torch.Tensor]:
        """Every group member's tensor, in group order (``mesh.group_ranks``)."""
        axes, group = self._begin("all_gather", axes)
        _check_tensor(t, "all_gather")
        self.traffic[("all_gather", axes, _nbytes(t))] += 1
        if len(group) == 1:
            return [_fresh(t)]
        return self._all_gather(t, group, f"all_gather over axes {axes}: {describe(t)}")

    def reduce_scatter(self, chunks: Sequence[torch.Tensor], axes: Sequence[int], op: str = "sum") -> torch.Tensor:
        """``op`` over the group of ``chunks[i]``, delivered to the member at group index i."""
        axes, group = self._begin("reduce_scatter", axes)
        chunks = _check_chunks(chunks, len(group), "reduce_scatter")
        _check_op(op, "reduce_scatter")
        self.traffic[("reduce_scatter", axes, sum(_nbytes(c) for c in chunks))] += 1
        if len(group) == 1:
            return _fresh(chunks[0])
        desc = f"reduce_scatter(op={op}) over axes {axes}: {[describe(c) for c in chunks]}"
        return self._reduce_scatter(chunks, group, op, desc)

    def all_to_all(self, chunks: Sequence[torch.Tensor], axes: Sequence[int]) -> list[torch.Tensor]:
        """Send ``chunks[i]`` to group member i; element j of the result came from member j.

        Every rank must pass the same chunk shapes (checked), so receive buffers are known.
        """
        axes, group = self._begin("all_to_all", axes)
        chunks = _check_chunks(chunks, len(group), "all_to_all")
        self.traffic[("all_to_all", axes, sum(_nbytes(c) for c in chunks))] += 1
        if len(group) == 1:
            return [_fresh(chunks[0])]
        desc = f"all_to_all over axes {axes}: {[describe(c) for c in chunks]}"
        return self._all_to_all(chunks, group, desc)

    def broadcast(self, t: torch.Tensor, axes: Sequence[int], src: int) -> torch.Tensor:
        """The tensor of group member ``src`` (an index in group order) on every member;
        the other members' ``t`` only gives shape and dtype."""
        axes, group = self._begin("broadcast", axes)
        _check_tensor(t, "broadcast")
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < len(group):
            raise CollectiveError(f"broadcast src must be a group index in 0..{len(group) - 1} "
                                  f"for axes {axes} of mesh {self.mesh.shape}, got {src!r}")
        self.traffic[("broadcast", axes, _nbytes(t))] += 1
        if len(group) == 1:
            return _fresh(t)
        return self._broadcast(t, group, src, f"broadcast(src={src}) over axes {axes}: {describe(t)}")

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Blocking point-to-point send to global rank ``dst`` (returns once received)."""
        _check_tensor(t, "send")
        self._check_peer(dst, "send", "dst")
        self.counts[("send", ())] += 1
        self.traffic[("send", (), _nbytes(t))] += 1
        self._send(t, dst)

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        """Receive from global rank ``src`` a tensor of ``like``'s shape and dtype."""
        _check_tensor(like, "recv")
        self._check_peer(src, "recv", "src")
        self.counts[("recv", ())] += 1
        self.traffic[("recv", (), _nbytes(like))] += 1
        return self._recv(like, src)

    def barrier(self, axes: Sequence[int] | None = None) -> None:
        """Wait for every member of the group (the whole mesh when ``axes`` is None); not counted."""
        axes = tuple(range(self.mesh.ndim)) if axes is None else self.mesh.check_axes(axes)
        group = self.mesh.group_ranks(self.rank, axes)
        if len(group) > 1:
            self._barrier(group, f"barrier over axes {axes}")

    def process_group(self, axes: Sequence[int]) -> ProcessGroup | None:
        return None

    # ---- helpers ----------------------------------------------------------------------
    def _begin(self, kind: str, axes: Sequence[int]) -> tuple[Axes, tuple[int, ...]]:
        try:
            axes, group = _group_of(self.mesh, self.rank, tuple(axes))
        except TypeError:   # unhashable axes: let the mesh say what is wrong with them
            axes = self.mesh.check_axes(axes)
            group = self.mesh.group_ranks(self.rank, axes)
        self.counts[(kind, axes)] += 1
        return axes, group

    def _check_peer(self, peer: int, kind: str, name: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.mesh.size:
            raise CollectiveError(f"{kind} {name} must be a rank in 0..{self.mesh.size - 1}, got {peer!r}")
        if peer == self.rank:
            raise CollectiveError(f"rank {self.rank} cannot {kind} to/from itself")

    # ---- transport (subclasses) ---------------------------------------------------------
    def _all_reduce(self, t, group, op, desc):  # pragma: no cover - abstract
        raise NotImplementedError

    def _all_gather(self, t, group, desc):  # pragma: no cover - abstract
        raise NotImplementedError

    def _reduce_scatter(self, chunks, group, op, desc):  # pragma: no cover - abstract
        raise NotImplementedError

    def _all_to_all(self, chunks, group, desc):  # pragma: no cover - abstract
        raise NotImplementedError

    def _broadcast(self, t, group, src, desc):  # pragma: no cover - abstract
        raise NotImplementedError

    def _send(self, t, dst):  # pragma: no cover - abstract
        raise NotImplementedError

    def _recv(self, like, src):  # pragma: no cover - abstract
        raise NotImplementedError

    def _barrier(self, group, desc):  # pragma: no cover - abstract
        raise NotImplementedError


@functools.lru_cache(maxsize=1024)
def _group_of(mesh: DeviceMesh, rank: int, axes: tuple) -> tuple[Axes, tuple[int, ...]]:
    """Validated axes and the group of ``rank`` over them (asked for by every collective)."""
    axes = mesh.check_axes(axes)
    return axes, mesh.group_ranks(rank, axes)


def reduce_tensors(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce in the given (group) order, so every rank computes bit-identical results."""
    out = tensors[0].detach().clone()
    for other in tensors[1:]:
        if op == "sum":
            out.add_(other)
        elif op == "max":
            torch.maximum(out, other, out=out)
        else:
            torch.minimum(out, other, out=out)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _check_tensor(t: object, kind: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise CollectiveError(f"{kind} needs a torch.Tensor, got {type(t).__name__}: {t!r}")


def _check_op(op: object, kind: str) -> None:
    if op not in REDUCE_OPS:
        raise CollectiveError(f"{kind} op must be one of {REDUCE_OPS}, got {op!r}")


def _check_chunks(chunks: object, group_size: int, kind: str) -> list[torch.Tensor]:
    if isinstance(chunks, torch.Tensor) or not isinstance(chunks, (list, tuple)):
        raise CollectiveError(f"{kind} needs a list of {group_size} tensors (one per group member), "
                              f"got {type(chunks).__name__}")
    chunks = list(chunks)
    if len(chunks) != group_size:
        raise CollectiveError(f"{kind} needs one chunk per group member ({group_size}), got {len(chunks)}")
    for c in chunks:
        _check_tensor(c, kind)
    dtypes = {c.dtype for c in chunks}
    if len(dtypes) > 1:
        raise CollectiveError(f"{kind} chunks must share one dtype, got {[describe(c) for c in chunks]}")
    return chunks
