"""A whole model captured for a plan the first time: torch.fx first (its graph names the seed
ops' strategies as the specs do), torch.export when fx cannot trace the model (HF transformers'
models, most real ones), said in a note; a model neither captures is one error naming the
model, both captures' reasons and what to try, or, when the model does not even run on the
inputs given, the input and what the model wanted (:mod:`shardverify.plan.inputs`). The
captured graph is refused before any strategy runs if it draws random numbers (dropout in
training mode): the sharded run and the single device would draw different ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import contextlib
import logging

import torch
from torch import fx

from shardverify.capture.export import CaptureError
from shardverify.capture.fx import unprinted_tracebacks
from shardverify.errors import InvalidArgument, ShardVerifyError
from shardverify.plan.inputs import KeywordInputs, diagnose_inputs

__all__ = ["CAPTURE_CHOICES", "Captured", "capture_model", "RandomnessError", "random_nodes"]

#: what verify_plan's ``capture`` takes: "auto" tries fx, then export
CAPTURE_CHOICES = ("auto", "fx", "export")


class RandomnessError(InvalidArgument):
    """The model draws random numbers (dropout in training mode): no plan check can compare it."""


@dataclass(frozen=True)
class Captured:
    graph: fx.GraphModule
    capture: str          # "fx" or "export": the one the plan and its check use
    note: str = ""        # why it is not the one asked for


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def capture_model(module: torch.nn.Module, inputs: tuple, capture: str = "auto") -> Captured:
    """The model's graph for a plan (see the module docstring); ``capture``: auto, fx or export."""
    from shardverify.plan.recipe import ModelRecipe, traced

    if capture not in CAPTURE_CHOICES:
        raise InvalidArgument(f"capture must be one of {', '.join(CAPTURE_CHOICES)}, got {capture!r}")
    keywords = isinstance(module, KeywordInputs)
    name = type(module.model if keywords else module).__name__
    reasons = []
    tries = ("export",) if capture == "auto" and keywords else ("fx", "export") if capture == "auto" else (capture,)
    for how in tries:
        try:
            with _quiet():
                graph = traced(ModelRecipe(module, inputs, capture=how))
        except Exception as error:  # noqa: BLE001 - torch raises many kinds; each is a reason to say
            cause = error.__cause__ if isinstance(error, CaptureError) and error.__cause__ else error
            reasons.append(f"torch.{how}: {_one_line(cause)}")
            continue
        refuse_randomness(graph, name)
        note = "" if how == capture or (how == "fx" and not reasons) else \
            "captured with torch.export (keyword inputs)" if not reasons else \
            f"captured with torch.export: torch.fx cannot trace {name} ({reasons[0][len('torch.fx: '):][:200]})"
        return Captured(graph, how, note)
    try:
        problem = diagnose_inputs(module, inputs)
    except Exception:  # noqa: BLE001 - the diagnosis is a better message, never a new failure
        problem = None
    if problem:
        raise problem
    hint = ("give the model inputs it runs on (check model(*inputs) runs) or a capture that works: "
            + ("capture='export' (--capture export)" if capture == "fx" else
               "make the forward exportable (torch.export.export(model, inputs) shows where it stops)"))
    raise CaptureError(f"cannot capture {name}: " + "; ".join(reasons) + f". Try: {hint}")


@contextlib.contextmanager
def _quiet():
    """A failed capture is one reason in the error said here, not torch's logged tracebacks."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with unprinted_tracebacks():
            yield
    finally:
        logger.setLevel(level)


def random_nodes(graph: fx.GraphModule) -> list[str]:
    """The nodes that draw random numbers, described (see :func:`draws_random`)."""
    return [found for node in graph.graph.nodes if (found := draws_random(node, graph))]


def draws_random(node: fx.Node, graph: fx.GraphModule) -> str:
    """How ``node`` draws random numbers ("" when it does not): ATen ops tagged
    nondeterministic_seeded (``aten.dropout`` with train=True, ``bernoulli``, ``rand``), dropout
    modules and functions in training mode; a dropout of probability 0 draws nothing that
    matters and is not listed."""
    target, args = node.target, list(node.args)
    if node.op == "call_module":
        sub = graph.get_submodule(str(target))
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.training and sub.p > 0:
            return f"{node.name} ({type(sub).__name__}(p={sub.p}) in training mode)"
    elif node.op == "call_function" and target in (torch.nn.functional.dropout, torch.dropout):
        p = args[1] if len(args) > 1 else node.kwargs.get("p", 0.5)
        train = args[2] if len(args) > 2 else node.kwargs.get("training", node.kwargs.get("train", True))
        if train and p:
            return f"{node.name} (dropout p={p}, training)"
    elif node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
            and torch.Tag.nondeterministic_seeded in target.tags \
            and not target.name().startswith(("aten::empty", "aten::new_empty")):
        given = _schema_values(target, args, node.kwargs)
        p = next((given[k] for k in ("p", "dropout_p") if k in given), None)
        if given.get("train", True) is not False and p != 0:   # else: draws nothing that matters
            return f"{node.name} ({target.name()}" + (f" p={p}" if p is not None else "") + ", random)"
    return ""


def _schema_values(target, args: list, kwargs: dict) -> dict:
    """The op's argument values by schema name, defaults included."""
    values = {}
    for i, argument in enumerate(target._schema.arguments):
        if i < len(args):
            values[argument.name] = args[i]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


def refuse_randomness(graph: fx.GraphModule, name: str) -> None:
    found = random_nodes(graph)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise RandomnessError(
            f"{name} draws random numbers in training mode at {', '.join(found[:3])}{more}: the sharded ranks "
            "and the single device cannot draw the same ones, so no plan check can compare them; verify the "
            "model in eval mode (model.eval(); the CLI's default without --train) or with dropout 0")


def as_shardverify_error(error: BaseException, what: str) -> ShardVerifyError:
    """A raw exception out of a plan's making, as a ShardVerifyError naming ``what`` was being done."""
    if isinstance(error, ShardVerifyError):
        return error
    return InvalidArgument(f"{what}: {_one_line(error)}")
