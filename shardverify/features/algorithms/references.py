"""What each collective must compute, stated once and independently of its implementations.

A :class:`Reference` gives, for a group whose ranks hold inputs ``xs`` (in group order):

* ``expected(xs, pos, params)``: the result at group position ``pos`` as plain single-process
  torch ops (differentiable, so the expected gradients follow by autograd), or ``None``
  where the collective defines no result;
* ``invalid(shape, p, params)``: why the call is impossible (so every implementation must
  raise ``CollectiveError``), or ``None``;
* ``builtin(t, group, ranks, pos, params)``: the same collective through the
  ``torch.distributed`` builtin on a real process group, the ground truth on that backend.

Implementations are verified against these by :mod:`shardverify.features.algorithms.check`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["REQUIRED", "Reference", "REFERENCES", "get_reference"]

REQUIRED = object()   # a parameter the spec must give


@dataclass(frozen=True)
class Reference:
    name: str
    params: tuple[tuple[str, object], ...]      # accepted parameters and their defaults
    expected: Callable[[Sequence[Tensor], int, Mapping[str, object]], Tensor | None]
    invalid: Callable[[tuple[int, ...], int, Mapping[str, object]], str | None]
    builtin: Callable[..., Tensor | None]

    def resolve(self, params: Mapping[str, object]) -> dict[str, object]:
        """The reference's parameters from ``params`` (others are the implementation's own),
        with defaults filled in; raises KeyError naming a missing required one."""
        resolved = {}
        for name, default in self.params:
            value = params.get(name, default)
            if value is REQUIRED:
                raise KeyError(name)
            resolved[name] = value
        return resolved


# --------------------------------------------------------------------------- validity


def _dim_problem(shape: tuple[int, ...], dim: object, name: str = "dim") -> str | None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        return f"{name}={dim!r} is not an int"
    if not shape:
        return f"{name}={dim} on a 0-d tensor"
    if not -len(shape) <= dim < len(shape):
        return f"{name}={dim} out of range for shape {shape}"
    return None


def _divisible_problem(shape: tuple[int, ...], dim: int, p: int, name: str = "dim") -> str | None:
    size = shape[dim % len(shape)]
    return f"size {size} of {name}={dim} not divisible by group size {p}" if size % p else None


def _position_problem(value: object, p: int, name: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < p:
        return f"{name}={value!r} not a position in a group of {p}"
    return None


def _first(*problems: Callable[[], str | None]) -> str | None:
    for problem in problems:
        found = problem()
        if found:
            return found
    return None


# --------------------------------------------------------------------------- helpers


def _sum(xs: Sequence[Tensor]) -> Tensor:
    return torch.stack(list(xs)).sum(0, dtype=xs[0].dtype)


def _chunks(t: Tensor, dim: int, p: int) -> list[Tensor]:
    size = t.shape[dim] // p
    return [t.narrow(dim, i * size, size).contiguous() for i in range(p)]


def _dist():
    import torch.distributed as dist

    return dist


_EXTREMA = {"sum": _sum, "max": lambda xs: torch.stack(list(xs)).amax(0),
            "min": lambda xs: torch.stack(list(xs)).amin(0)}


# --------------------------------------------------------------------------- the references


def _pg_order(ranks: Sequence[int]) -> list[int]:
    """For each rank of the process group (ranks ascending), its position in group order:
    builtins list tensors by process-group rank, the references by group position."""
    return [ranks.index(r) for r in sorted(ranks)]


def _to_group_order(by_pg: list[Tensor], ranks: Sequence[int]) -> list[Tensor]:
    result: list[Tensor] = [by_pg[0]] * len(ranks)
    for pg_rank, position in enumerate(_pg_order(ranks)):
        result[position] = by_pg[pg_rank]
    return result


def _to_pg_order(by_position: list[Tensor], ranks: Sequence[int]) -> list[Tensor]:
    return [by_position[position] for position in _pg_order(ranks)]


def _all_reduce_builtin(t, group, ranks, pos, params):
    dist = _dist()
    op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[params["op"]]
    out = t.clone()
    dist.all_reduce(out, op=op, group=group)
    return out


def _all_gather_builtin(t, group, ranks, pos, params):
    outs = [torch.empty_like(t) for _ in ranks]
    _dist().all_gather(outs, t.contiguous(), group=group)
    return torch.cat(_to_group_order(outs, ranks), params["dim"])


def _reduce_scatter_builtin(t, group, ranks, pos, params):
    chunks = _chunks(t, params["dim"], len(ranks))
    out = torch.empty_like(chunks[0])
    _dist().reduce_scatter(out, _to_pg_order(chunks, ranks), group=group)
    return out


def _all_to_all_builtin(t, group, ranks, pos, params):
    chunks = _chunks(t, params["split_dim"], len(ranks))
    outs = [torch.empty_like(c) for c in chunks]
    _dist().all_to_all(outs, _to_pg_order(chunks, ranks), group=group)
    return torch.cat(_to_group_order(outs, ranks), params["concat_dim"])


def _broadcast_builtin(t, group, ranks, pos, params):
    out = t.clone()
    _dist().broadcast(out, src=ranks[params["src"]], group=group)
    return out


def _reduce_builtin(t, group, ranks, pos, params):
    out = t.clone()
    _dist().reduce(out, dst=ranks[params["dst"]], group=group)
    return out if pos == params["dst"] else None


def _gather_builtin(t, group, ranks, pos, params):
    mine = pos == params["dst"]
    outs = [torch.empty_like(t) for _ in ranks] if mine else None
    _dist().gather(t.contiguous(), outs, dst=ranks[params["dst"]], group=group)
    return torch.cat(_to_group_order(outs, ranks), params["dim"]) if mine else None


def _scatter_builtin(t, group, ranks, pos, params):
    chunks = _chunks(t, params["dim"], len(ranks))
    out = torch.empty_like(chunks[0])
    _dist().scatter(out, _to_pg_order(chunks, ranks) if pos == params["src"] else None,
                    src=ranks[params["src"]], group=group)
    return out


def _all_to_all_expected(xs, pos, params):
    p = len(xs)
    return torch.cat([_chunks(x, params["split_dim"], p)[pos] for x in xs], params["concat_dim"])


REFERENCES: dict[str, Reference] = {ref.name: ref for ref in (
    Reference(
        "all_reduce", (("op", "sum"),),
        expected=lambda xs, pos, k: _EXTREMA[k["op"]](xs),
        invalid=lambda shape, p, k: None if k["op"] in _EXTREMA else f"op={k['op']!r} is not sum, max or min",
        builtin=_all_reduce_builtin),
    Reference(
        "all_gather", (("dim", 0),),
        expected=lambda xs, pos, k: torch.cat(list(xs), k["dim"]),
        invalid=lambda shape, p, k: _dim_problem(shape, k["dim"]),
        builtin=_all_gather_builtin),
    Reference(
        "reduce_scatter", (("dim", 0),),
        expected=lambda xs, pos, k: _chunks(_sum(xs), k["dim"], len(xs))[pos],
        invalid=lambda shape, p, k: _first(lambda: _dim_problem(shape, k["dim"]),
                                           lambda: _divisible_problem(shape, k["dim"], p)),
        builtin=_reduce_scatter_builtin),
    Reference(
        "all_to_all", (("split_dim", REQUIRED), ("concat_dim", REQUIRED)),
        expected=_all_to_all_expected,
        invalid=lambda shape, p, k: _first(
            lambda: _dim_problem(shape, k["split_dim"], "split_dim"),
            lambda: _dim_problem(shape, k["concat_dim"], "concat_dim"),
            lambda: _divisible_problem(shape, k["split_dim"], p, "split_dim")),
        builtin=_all_to_all_builtin),
    Reference(
        "broadcast", (("src", 0),),
        expected=lambda xs, pos, k: xs[k["src"]].clone(),
        invalid=lambda shape, p, k: _position_problem(k["src"], p, "src"),
        builtin=_broadcast_builtin),
    Reference(
        "reduce", (("dst", 0),),
        expected=lambda xs, pos, k: _sum(xs) if pos == k["dst"] else None,
        invalid=lambda shape, p, k: _position_problem(k["dst"], p, "dst"),
        builtin=_reduce_builtin),
    Reference(
        "gather", (("dim", 0), ("dst", 0)),
        expected=lambda xs, pos, k: torch.cat(list(xs), k["dim"]) if pos == k["dst"] else None,
        invalid=lambda shape, p, k: _first(lambda: _dim_problem(shape, k["dim"]),
                                           lambda: _position_problem(k["dst"], p, "dst")),
        builtin=_gather_builtin),
    Reference(
        "scatter", (("dim", 0), ("src", 0)),
        expected=lambda xs, pos, k: _chunks(xs[k["src"]], k["dim"], len(xs))[pos],
        invalid=lambda shape, p, k: _first(lambda: _dim_problem(shape, k["dim"]),
                                           lambda: _divisible_problem(shape, k["dim"], p),
                                           lambda: _position_problem(k["src"], p, "src")),
        builtin=_scatter_builtin),
)}


def get_reference(name: str) -> Reference:
    try:
        return REFERENCES[name]
    except KeyError:
        raise KeyError(f"unknown collective reference {name!r}; known: {', '.join(REFERENCES)}") from None
