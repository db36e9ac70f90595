"""A case at a larger shape: the same op, module and parameters on more rows.

A grid case is small; a benchmark or a precision study wants it grown to the shapes models run.
Multiplying every dim would grow dims the case cannot grow: a contracted dim (matmul's inner
dim, shared by two inputs), a feature or channel dim (a module's in_features, a conv's
in_channels), a dim another input must match. Rather than one rule per op, the scaling is found
from the case itself. Each leading dim of the first input (all but its last, as linear's rows and
conv's batch and height) is tried in turn, multiplied by the factor:

  * alone, kept if the case still builds (shapes propagated on meta tensors: cheap);
  * else with the dims of the other inputs it must match (the fewest equal-sized dims of the other
    inputs that make the case build, the dim in the same place counted from the right tried
    first), kept only if the op's result grew: a dim shared by two inputs that leaves the result's
    size as it was is contracted, and growing it would measure another reduction, not more rows.

A dim of size 1 (it broadcasts) and an input with exact ``data`` are never scaled. For one-input
cases (linear, sum) this is the rule the benchmark always had, every leading dim multiplied.
A case none of whose dims can grow is an InvalidArgument naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import math
from typing import NamedTuple

from shardverify.capture.meta import output_metas
from shardverify.errors import InvalidArgument
from shardverify.spec.case import OpCase

__all__ = ["Scaled", "scale_case"]

#: partner sets tried per dim of the first input (the fewest partners first)
MAX_TRIES = 64


class Scaled(NamedTuple):
    """The grown case and which dims grew: ((input name, dim), ...)."""

    case: OpCase
    dims: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        """``input[0, 1], mat2[0]``: the dims multiplied, by input."""
        by_input: dict[str, list[int]] = {}
        for name, dim in self.dims:
            by_input.setdefault(name, []).append(dim)
        return ", ".join(f"{name}{dims}" for name, dims in by_input.items())


def scale_case(case: OpCase, factor: int) -> Scaled:
    """``case`` with its free dims multiplied by ``factor`` (module docstring)."""
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise InvalidArgument(f"scale factor must be a positive int, got {factor!r}")
    if not case.inputs:
        raise InvalidArgument(f"{case.describe()}: no input to scale")
    if factor == 1:
        return Scaled(case, ())
    first = case.inputs[0]
    chosen: list[tuple[int, int]] = []   # (input index, dim)
    refused: list[str] = []   # why each leading dim of the first input stayed
    if first.data is not None:
        refused.append(f"{first.name} has exact data")
    else:
        size = _result_size(case)   # the result's size with the dims chosen so far scaled
        leading = range(len(first.shape) - 1) if len(first.shape) > 1 else range(len(first.shape))
        for dim in leading:
            if first.shape[dim] == 1:
                refused.append(f"{first.name}[{dim}] is 1 (broadcast)")
                continue
            contracted = []
            for partners in _partner_sets(case, dim):
                trial = chosen + [(0, dim)] + partners
                grown = _grown(case, trial, factor)
                if grown is None:
                    continue
                grown_size = _result_size(grown)
                if partners and grown_size <= size:   # shared by two inputs, the result no larger: contracted
                    contracted.append(_named(case, partners))
                    continue
                chosen, size = trial, grown_size
                break
            else:
                refused.append(f"{first.name}[{dim}] " + (
                    f"is contracted with {' or '.join(contracted)}" if contracted else
                    "does not build grown, alone or with any equal-sized dims of the other inputs"))
    if not chosen:
        raise InvalidArgument(f"{case.describe()}: no dim of its first input can be multiplied by {factor}: "
                              + "; ".join(refused))
    grown = _grown(case, chosen, factor)
    assert grown is not None
    return Scaled(grown, tuple((case.inputs[i].name, d) for i, d in chosen))


def _named(case: OpCase, dims: list[tuple[int, int]]) -> str:
    return " and ".join(f"{case.inputs[i].name}[{d}]" for i, d in dims)


def _partner_sets(case: OpCase, dim: int):
    """Lists of (input index, dim) of the other inputs to scale with the first input's ``dim``:
    none first, then the fewest partners, each input's dim in the same place from the right first."""
    size, rank0 = case.inputs[0].shape[dim], len(case.inputs[0].shape)
    options = []
    for index, decl in enumerate(case.inputs[1:], start=1):
        if decl.data is not None:
            continue
        same = [k for k, n in enumerate(decl.shape) if n == size and n != 1]
        same.sort(key=lambda k: (k - len(decl.shape) != dim - rank0, k != dim, k))
        if same:
            options.append([(index, k) for k in same])
    tried = 0
    for count in range(len(options) + 1):
        for inputs in itertools.combinations(options, count):
            for partners in itertools.product(*inputs):
                yield list(partners)
                tried += 1
                if tried >= MAX_TRIES:
                    return


def _grown(case: OpCase, dims: list[tuple[int, int]], factor: int) -> OpCase | None:
    """``case`` with ``dims`` multiplied, or None when it no longer builds."""
    inputs = list(case.inputs)
    for index, dim in dims:
        decl = inputs[index]
        inputs[index] = dataclasses.replace(decl, shape=tuple(n * factor if k == dim else n
                                                              for k, n in enumerate(decl.shape)))
    grown = dataclasses.replace(case, inputs=tuple(inputs))
    try:
        with contextlib.redirect_stderr(io.StringIO()):   # fx's ShapeProp prints the traceback of a failure
            grown.build()
    except Exception:  # noqa: BLE001 - any failure to trace or propagate shapes: these dims cannot grow
        return None
    return grown


def _result_size(case: OpCase) -> int:
    """Elements of the op's result(s) as the case builds."""
    graph_module, node_name = case.build()
    node = next(n for n in graph_module.graph.nodes if n.name == node_name)
    return sum(math.prod(m.shape) for m in output_metas(node) or () if m is not None)
