"""What an offered strategy asks of the op: the layouts the op *sees* once the BEFORE
actions ran (a post-added operand is absent, a partial input partial), and the raw output
layouts before the AFTER actions (an all-reduce after the op means a partial output).

That pair is what the audit's enumeration decides, so coverage is a plain lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.sharding.layout import Layout
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import CommPattern, CommWhere, OperationDataType, ShardingStrategy

__all__ = ["Offered", "offered_combination", "output_shape_argument", "local_argument_choices", "own_arguments"]


@dataclass(frozen=True)
class Offered:
    """One strategy as a combination: ``inputs`` and ``outputs`` as (operand name, layout);
    ``problem`` says why it cannot be expressed as one (then the rest is meaningless)."""

    strategy: str
    inputs: tuple[tuple[str, Layout], ...]
    outputs: tuple[tuple[str, Layout], ...]
    problem: str = ""


def _drop_suffix(layout: Layout, dim: int, axes: tuple[int, ...]) -> Layout | None:
    held = layout.dims[dim]
    if len(held) < len(axes) or held[len(held) - len(axes):] != axes:
        return None
    dims = list(layout.dims)
    dims[dim] = held[:len(held) - len(axes)]
    return Layout(tuple(dims), layout.partial, layout.reduce, layout.absent)


def _append(layout: Layout, dim: int, axes: tuple[int, ...]) -> Layout:
    dims = list(layout.dims)
    dims[dim] = dims[dim] + axes
    return Layout(tuple(dims), layout.partial, layout.reduce, layout.absent)


def _gather(layout: Layout, dim: int, axes: tuple[int, ...]) -> Layout | None:
    return _drop_suffix(layout, dim % len(layout.dims), axes)


def _split(layout: Layout, dim: int, axes: tuple[int, ...]) -> Layout:
    return _append(layout, dim % len(layout.dims), axes)


def _outputs(strategy: ShardingStrategy) -> list:
    return list(strategy.outputs)


def offered_combination(strategy: ShardingStrategy) -> Offered:
    """The combination ``strategy`` runs the op on (see the module docstring)."""
    outputs = _outputs(strategy)
    out_names = {o.name for o in outputs}
    post_added = {p.operand for p in strategy.post_add}
    seen: dict[str, Layout] = {}
    for data in strategy.operands:
        if data.name in out_names or data.type is OperationDataType.OUTPUT:
            continue
        layout = Layout.of_spec(strategy.get_sharding_spec_by_name(data.name))
        if data.name in post_added:
            layout = Layout(layout.dims, absent=True)
        elif strategy.partial_axes(data.name):
            layout = Layout(layout.dims, strategy.partial_axes(data.name), strategy.partial_input(data.name).op)
        seen[data.name] = layout
    raw = {o.name: Layout.of_spec(strategy.get_sharding_spec_by_name(o.name)) for o in outputs}
    problem = ""

    for action in strategy.communication_actions:
        if action.where is not CommWhere.BEFORE or action.operand not in seen:
            continue
        layout, what = seen[action.operand], f"{action.pattern.name} before the op on {action.operand!r}"
        if action.pattern is CommPattern.GATHER_FWD_SPLIT_BWD:
            new = _gather(layout, action.dims[0], action.axes)
        elif action.pattern is CommPattern.SPLIT_FWD_GATHER_BWD:
            new = _split(layout, action.dims[0], action.axes)
        elif action.pattern is CommPattern.ALL2ALL_FWD_ALL2ALL_BWD:
            gathered = _gather(layout, action.dims[1], action.axes)
            new = None if gathered is None else _split(gathered, action.dims[0], action.axes)
        elif action.pattern is CommPattern.ALLREDUCE_FWD_IDENTITY_BWD:
            new, problem = layout, problem or f"{what}: all-reduces an input the strategy holds as a full value"
        else:
            new = layout   # identity forward
        if new is None:
            problem = problem or f"{what}: gathers mesh axes {action.axes} that do not end dim {action.dims}'s sharding"
            new = layout
        seen[action.operand] = new

    # AFTER actions turn the raw output into the declared one: undo them, last first.
    for action in reversed(strategy.communication_actions):
        if action.where is not CommWhere.AFTER or action.operand not in raw:
            continue
        layout, what = raw[action.operand], f"{action.pattern.name} after the op on {action.operand!r}"
        if action.pattern is CommPattern.ALLREDUCE_FWD_IDENTITY_BWD:
            if layout.partial:
                problem = problem or f"{what}: two reductions of one output"
                continue
            raw[action.operand] = Layout(layout.dims, tuple(sorted(action.axes)), action.op)
        elif action.pattern is CommPattern.GATHER_FWD_SPLIT_BWD:
            raw[action.operand] = _split(layout, action.dims[0], action.axes)
        elif action.pattern is CommPattern.SPLIT_FWD_GATHER_BWD:
            new = _gather(layout, action.dims[0], action.axes)
            if new is None:
                problem = problem or f"{what}: splits over axes the declared output does not end with"
            else:
                raw[action.operand] = new
        elif action.pattern is CommPattern.ALL2ALL_FWD_ALL2ALL_BWD:
            undone = _gather(layout, action.dims[0], action.axes)
            if undone is None:
                problem = problem or f"{what}: the declared output is not split over {action.axes}"
            else:
                raw[action.operand] = _split(undone, action.dims[1], action.axes)
    return Offered(strategy.name, tuple(seen.items()), tuple((o.name, raw[o.name]) for o in outputs), problem)


def output_shape_argument(strategies) -> tuple[tuple[str, object], slice] | None:
    """The call argument every strategy that localizes one sets to its first output's local
    shape (a view's ``shape``) or to a run of it (the sizes unflatten splits a dim into), as
    a (kind, key) locator and the slice of the local shape; None when there is none.  The
    audit passes that part of each candidate output layout's local shape there, as such a
    strategy would.  Where several runs of the shape fit every strategy, the first is taken."""
    fits: dict[tuple[str, object], set[tuple[int, int]]] = {}
    for strategy in strategies:
        out = strategy.outputs[0]
        local = strategy.get_sharding_spec_by_name(out.name).local_shape()
        for arg in strategy.local_args:
            if not isinstance(arg.value, (tuple, list)):
                continue
            value, width = tuple(arg.value), len(arg.value)
            runs = {(i, i + width) for i in range(len(local) - width + 1) if local[i:i + width] == value}
            key = (arg.locator.kind, arg.locator.key)
            fits[key] = runs if key not in fits else fits[key] & runs
    found = [(key, min(runs)) for key, runs in fits.items() if runs]
    if len(found) != 1:
        return None
    key, (start, stop) = found[0]
    return key, slice(start, stop)


def local_argument_choices(strategies, mesh) -> list[list[dict]]:
    """Every distinct per-rank set of the other local arguments the strategies pass (a conv's
    ``groups``: each rank's own count of groups), as a list of ``{(kind, key): value}`` per rank.
    The audit tries a combination the recorded arguments do not run with each of them in turn:
    it finds the layouts a rank's own argument makes valid, and decides them numerically."""
    found: dict = {}
    for strategy in strategies:
        others = [arg for arg in strategy.local_args if not isinstance(arg.value, (tuple, list))]
        if others:
            per_rank = [{(arg.locator.kind, arg.locator.key): arg.value_on(rank) for arg in others}
                        for rank in mesh.ranks]
            found.setdefault(tuple(tuple(sorted(a.items(), key=repr)) for a in per_rank), per_rank)
    return list(found.values())


def own_arguments(strategy, shape_arg, mesh: DeviceMesh) -> list[dict] | None:
    """Each rank's local arguments of a strategy that passes any besides the output shape the
    audit knows how to localize (``shape_arg``); None for every other strategy."""
    shape_key = shape_arg[0] if shape_arg is not None else None
    if all((a.locator.kind, a.locator.key) == shape_key for a in strategy.local_args):
        return None
    return [{(a.locator.kind, a.locator.key): a.value_on(rank) for a in strategy.local_args} for rank in mesh.ranks]
