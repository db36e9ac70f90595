"""A whole model captured for a plan the first time: torch.fx first (its graph names the seed
ops' strategies as the specs do), torch.export when fx cannot trace the model (HF transformers'
models, most real ones), said in a note; a model neither captures is one error naming the
model, both captures' reasons and what to try, or, when the model does not even run on the
inputs given, the input and what the model wanted (:mod:`shardverify.plan.inputs`). The nodes
that draw random numbers (dropout in training mode) are listed: each is checked with every rank
drawing from the generator state the single device draws from (capture/randomness.py), which a
sharded run must give its ranks, and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import contextlib
import logging

import torch
from torch import fx

from shardverify.capture.export import CaptureError
from shardverify.capture.fx import unprinted_tracebacks
from shardverify.capture.randomness import draws_random
from shardverify.errors import InvalidArgument, ShardVerifyError
from shardverify.plan.inputs import KeywordInputs, diagnose_inputs

__all__ = ["CAPTURE_CHOICES", "Captured", "capture_model", "random_nodes", "drawing_note"]

#: what verify_plan's ``capture`` takes: "auto" tries fx, then export
CAPTURE_CHOICES = ("auto", "fx", "export")


@dataclass(frozen=True)
class Captured:
    graph: fx.GraphModule
    capture: str          # "fx" or "export": the one the plan and its check use
    note: str = ""        # why it is not the one asked for
    drawing: tuple[str, ...] = ()   # the nodes that draw random numbers, described


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
        note = "" if how == capture or (how == "fx" and not reasons) else \
            "captured with torch.export (keyword inputs)" if not reasons else \
            f"captured with torch.export: torch.fx cannot trace {name} ({reasons[0][len('torch.fx: '):][:200]})"
        return Captured(graph, how, note, tuple(random_nodes(graph)))
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


def drawing_note(drawing: tuple[str, ...]) -> str:
    """What a plan says of its nodes that draw random numbers ("" without one)."""
    if not drawing:
        return ""
    more = f" and {len(drawing) - 3} more" if len(drawing) > 3 else ""
    return (f"{len(drawing)} node(s) draw random numbers ({', '.join(drawing[:3])}{more}): each was checked with "
            "every rank drawing from the generator state the single device draws from, so a run of this plan "
            "must seed every rank alike (one seed for all ranks)")


def as_shardverify_error(error: BaseException, what: str) -> ShardVerifyError:
    """A raw exception out of a plan's making, as a ShardVerifyError naming ``what`` was being done."""
    if isinstance(error, ShardVerifyError):
        return error
    return InvalidArgument(f"{what}: {_one_line(error)}")
