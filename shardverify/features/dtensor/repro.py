"""A DTensor finding as data, and the standalone script reproducing it with torch alone (for a
PyTorch bug report).

No code is built from text: a finding's case (:func:`repro_case`) holds typed values only (the
mesh, each input's shape, dtype and written-out values, each rank's block, placements, the call's
torch name and literal arguments, taken from the live call, never from a stored finding's words),
and what runs is always the same program, ``repro_runner.py`` (:data:`RUNNER`), which validates
the case field by field before it builds anything. ``shardverify dtensor --confirm`` runs that
program under torchrun on the case written as JSON; a repro script for a report
(:func:`render_repro`) is the program with the case embedded as a Python literal
(``shardverify.pysource.py_literal``), under comment lines that say what was found (each line
escaped: only printable characters, never on the script's first two lines, where a comment could
set the source's encoding). It prints every rank's value of every output the finding checked,
its ``STAGE`` lines and its ``VERDICT`` line (:data:`VERDICT`) that ``--confirm`` reads from
every process, and exits with status 1 while DTensor is not right, 0 once it is.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import torch
from torch import fx

from shardverify.sharding.layout import Layout
from shardverify.capture.call import call_parts
from shardverify.pysource import py_literal
from shardverify.features.dtensor.placements import placement_json, placements_of

__all__ = ["repro_case", "render_repro", "comment_lines", "RUNNER", "VERDICT", "STAGE", "FORMAT"]

#: what starts the verdict line each process of a repro prints: "VERDICT " and a JSON object with
#: "ranks" (the ranks it speaks for), "status" and "detail"
VERDICT = "VERDICT "
#: what starts the line each process prints before each step ("the op", "full_tensor() of the
#: output", "the backward"): a JSON object with "ranks" and "stage"
STAGE = "STAGE "
#: the scripts' format: a confirmation stored for a script of another format is run again (the
#: STAGE lines say where a process died and change no verdict: format 2 still; format 3 checks and
#: differentiates every output the finding did, not the first alone; the case read as data by one
#: fixed program computes what format 3's scripts did, so it stays format 3)
FORMAT = 3
#: the one program every repro runs (torch alone: nothing of shardverify is importable there)
RUNNER = Path(__file__).with_name("repro_runner.py")
#: the line of :data:`RUNNER` a report's script puts its case on
_EMBED = "EMBEDDED = None   # a repro script written for a report holds its case here\n"
#: at most this many comment lines of at most this many characters each
_COMMENT_LINES, _COMMENT_WIDTH = 40, 300


class _Name:
    """An input of the case standing in for a tensor in the call."""

    def __init__(self, name: str) -> None:
        self.name = name


def _encoded(value: object) -> object:
    """A call argument as the case's data (``repro_runner._value`` reads it back)."""
    if isinstance(value, _Name):
        return {"tensor": value.name}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"tuple": [_encoded(v) for v in value]}
    if isinstance(value, list):
        return [_encoded(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[_key(k), _encoded(v)] for k, v in value.items()]}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"cannot write {type(value).__name__} {value!r} as a repro's value")


def _key(key: object) -> str:
    if not isinstance(key, str):
        raise ValueError(f"cannot write the key {key!r} as a repro's value")
    return key


def _module(module) -> dict:
    """A torch.nn module as its class and literal constructor arguments, read from its repr
    (``Linear(in_features=4, out_features=8, bias=True)``); a module whose repr is not such a
    call of a torch.nn class cannot be rendered."""
    tree = ast.parse(repr(module), mode="eval").body
    if not (isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name)
            and getattr(torch.nn, tree.func.id, None) is type(module)):
        raise ValueError(f"the module {type(module).__name__}'s repr is not a call of its torch.nn class")
    return {"class": tree.func.id, "args": [_encoded(ast.literal_eval(a)) for a in tree.args],
            "kwargs": [[k.arg, _encoded(ast.literal_eval(k.value))] for k in tree.keywords if k.arg]}


def _call(node: fx.Node, module, names: dict) -> dict:
    """The call of the case: its kind, target and arguments, each operand an input's name."""
    values = {loc: _Name(name) for loc, name in names.items()}
    args, kwargs, tensors = call_parts(node, module, values)
    if node.op == "call_function":
        kind, target = "function", fx.node._get_qualified_name(node.target).replace("_operator.", "operator.")
    elif node.op == "call_method":
        kind, target = "method", str(node.target)
    else:
        kind, target = "module", _module(module)
    return {"kind": kind, "target": target, "args": [_encoded(a) for a in args],
            "kwargs": [[_key(k), _encoded(v)] for k, v in kwargs.items()],
            "params": [[_key(k), _encoded(v)] for k, v in (tensors or {}).items()]}


def _values(value: torch.Tensor) -> object:
    """A tensor's values written out (finite numbers only: a value JSON and Python both read)."""
    listed = value.tolist()
    flat = value.reshape(-1).tolist()
    if any(isinstance(v, complex) or (isinstance(v, float) and not math.isfinite(v)) for v in flat):
        raise ValueError("cannot write complex or non-finite values into a repro")
    return listed


def _bounds(block: slice) -> list:
    """A rank's block of one dim as [start, stop] (None: the dim's start or end)."""
    if block.step not in (None, 1):
        raise ValueError(f"a block with step {block.step} cannot be written into a repro")
    return [None if block.start is None else int(block.start), None if block.stop is None else int(block.stop)]


def repro_case(problem, operands, combo: tuple[Layout, ...], mesh_shape: tuple[int, ...]) -> dict:
    """The case ``repro_runner.py`` runs for ``combo`` (one layout per operand) of the audit's
    ``problem``: typed values only, every one taken from the live call and its layouts."""
    world = math.prod(mesh_shape)
    inputs, blocks = [], []
    for i, (o, layout) in enumerate(zip(operands, combo)):
        value = problem.values[o.locator]
        if o.differentiable:
            inputs.append({"role": o.role, "shape": list(value.shape), "dtype": "float64", "values": None, "grad": True})
        else:   # a running statistic (float64, its drawn values) or an integer operand
            dtype = "float64" if value.is_floating_point() else str(value.dtype).removeprefix("torch.")
            inputs.append({"role": o.role, "shape": list(value.shape), "dtype": dtype, "values": _values(value),
                           "grad": False})
        partial = None
        if layout.partial:
            partial = {"count": math.prod(mesh_shape[a] for a in layout.partial), "seed": 1000 + i,
                       "index": [int(problem._index(r, layout.partial)) for r in range(world)]}
        blocks.append({"blocks": [[_bounds(s) for s in problem.slices(layout, o.shape, r)] for r in range(world)],
                       "partial": partial,
                       "placements": [placement_json(p) for p in placements_of(layout, mesh_shape)]})
    call = _call(problem.node, problem.module, {o.locator: o.role for o in operands})
    return {"format": "dtensor-repro-case", "version": 1, "mesh": [int(m) for m in mesh_shape], "inputs": inputs,
            "call": call, "out": [int(k) for k in problem.out_index], "operands": blocks}


def comment_lines(text: str) -> list[str]:
    """``text`` as comment lines: each line of it kept to its printable characters (no line
    break, carriage return, form feed or other control that could end a comment), a bounded
    number of bounded lines."""
    lines = ["# " + "".join(c if c.isprintable() else "?" for c in line)[:_COMMENT_WIDTH]
             for line in str(text).splitlines()[:_COMMENT_LINES]]
    return [line.rstrip() for line in lines]


def render_repro(problem, operands, combo: tuple[Layout, ...], mesh_shape: tuple[int, ...], title: str) -> str:
    """The standalone script for ``combo`` of the audit's ``problem``: :data:`RUNNER` with the
    case embedded, under ``title`` as escaped comment lines (words only: nothing of it is code)."""
    case = repro_case(problem, operands, combo, tuple(mesh_shape))
    runner = RUNNER.read_text(encoding="utf-8")
    if runner.count(_EMBED) != 1:
        raise ValueError(f"{RUNNER.name} has no line for an embedded case")
    world = math.prod(mesh_shape)
    header = ["# A DTensor finding reproduced with torch alone, generated by shardverify (`shardverify dtensor`).",
              "# Runs with torch alone: `python repro.py` (one process: LocalTensorMode, a fake process group),",
              f"# or `torchrun --nproc-per-node {world} repro.py` ({world} real gloo processes).", "#",
              *comment_lines(title), ""]
    embedded = f"EMBEDDED = {py_literal(case)}\n"
    return "\n".join(header) + "\n" + runner.replace(_EMBED, embedded)
