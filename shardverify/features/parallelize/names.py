"""Models and plans by the names a user gives them (the command line, a process that rebuilds them):
``hf:MODEL_TYPE`` (a transformers architecture built tiny), ``zoo:NAME``, ``hf`` (a transformers
config's own plan; ``hf:{...}`` with overrides), or the dotted name of a factory, a dict of ParallelStyles or a
``parallelize(model, mesh)`` function in the user's project (what the project's allow-list admits)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from shardverify.errors import InvalidArgument
from shardverify.features.parallelize.models import Batch, ModelSource, from_factory
from shardverify.features.parallelize.plans import Plan, function_plan, styles_plan, transformers_plan
from shardverify.features.parallelize.tiny import tiny_model
from shardverify.features.parallelize.zoo import zoo_model, zoo_plan

__all__ = ["resolve_model", "resolve_plan", "parse_overrides", "overrides_text", "CONFIG_PLAN"]


def _hf_source(model_type: str, seed: int) -> ModelSource:
    first = tiny_model(model_type, seed)   # raises CannotBuild with the reason

    def build() -> nn.Module:
        return tiny_model(model_type, seed).model

    def batch(step: int) -> Batch:
        if step == 0:
            return Batch(dict(first.inputs))
        gen = torch.Generator().manual_seed(seed * 1000 + step)
        inputs = {}
        for key, value in first.inputs.items():
            if value.dtype in (torch.int64, torch.int32) and key.endswith(("input_ids", "labels")):
                high = int(first.inputs[key].max()) + 1
                inputs[key] = torch.randint(0, max(high, 2), value.shape, generator=gen, dtype=value.dtype)
            else:
                inputs[key] = value
        if "labels" in inputs and "input_ids" in inputs:
            inputs["labels"] = inputs["input_ids"].clone()
        return Batch(inputs)

    return ModelSource(f"hf:{model_type}", build, batch, note=first.note, heads=first.heads)


def resolve_model(text: str, inputs: Sequence = (), seed: int = 0, project: Path | None = None) -> ModelSource:
    """``hf:MODEL_TYPE`` (a transformers architecture, tiny), ``zoo:NAME`` or a factory's dotted name."""
    if text.startswith("hf:"):
        return _hf_source(text[3:], seed)
    if text.startswith("zoo:"):
        return zoo_model(text[4:], seed)
    from shardverify.plan.inputs import parse_input
    from shardverify.spec.allow import resolve_allowed
    inputs = [parse_input(item) if isinstance(item, str) else item for item in inputs]
    if not inputs:
        raise InvalidArgument(f"model {text!r}: a factory needs its inputs (--input SHAPE, e.g. x=8,16)")
    factory = resolve_allowed(text, project or Path.cwd())
    return from_factory(text, factory, inputs, seed)


#: the names of a transformers config's own plan
CONFIG_PLAN = ("hf", "transformers", "auto")

#: the most rules an override may hold, and the longest pattern or style name
MAX_OVERRIDES, MAX_OVERRIDE_TEXT = 200, 300


def parse_overrides(text: str) -> dict[str, str]:
    """A transformers plan's overrides as data: a JSON object of module pattern to style name (what
    ``DistributedConfig(tp_plan=...)`` takes); a process rebuilds the plan from this text."""
    try:
        found = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"plan hf:{text[:80]!r}: the overrides are not JSON ({exc})") from None
    if not isinstance(found, dict) or len(found) > MAX_OVERRIDES or not all(
            isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= MAX_OVERRIDE_TEXT and 0 < len(v) <= MAX_OVERRIDE_TEXT
            for k, v in found.items()):
        raise InvalidArgument(f"plan hf:{text[:80]!r}: expected a JSON object of at most {MAX_OVERRIDES} module "
                              "patterns to style names, e.g. {\"embed_tokens\": \"embedding_colwise\"}")
    return found


def overrides_text(overrides: Mapping[str, str]) -> str:
    """The plan text of the config's plan with ``overrides`` (read back by :func:`resolve_plan`)."""
    return "hf:" + json.dumps(dict(overrides), sort_keys=True)


def file_plan_name(text: str, project: Path) -> str:
    """``PATH.py`` or ``PATH.py:NAME`` (a file under the current folder, such as ``shardverify plan
    --export-parallelize`` writes) as the dotted name of its ``parallelize`` function (or NAME); any
    other text as it is. The dotted name is then allowed or refused as any other."""
    path_text, sep, attribute = text.partition(".py:")
    if not sep and not text.endswith(".py"):
        return text
    resolved = (project / ((path_text if sep else text[:-3]) + ".py")).resolve()
    if not resolved.is_relative_to(project.resolve()):
        raise InvalidArgument(f"plan {text!r}: a plan file must lie under the current folder {str(project)!r}")
    if not resolved.is_file():
        raise InvalidArgument(f"plan {text!r}: no such file under {str(project)!r}")
    parts = resolved.relative_to(project.resolve()).with_suffix("").parts
    if not all(part.isidentifier() for part in parts):
        raise InvalidArgument(f"plan {text!r}: each folder and the file's name must be a Python identifier "
                              "(it is imported as a module)")
    return ".".join(parts) + ":" + (attribute or "parallelize")


def resolve_plan(text: str, project: Path | None = None, loss_parallel: bool = False) -> Plan:
    """``hf`` (the transformers config's own plan), ``hf:{JSON overrides}`` (it with overrides, as
    ``DistributedConfig(tp_plan=...)`` merges them), ``zoo:NAME``, or the dotted name of a dict of
    ParallelStyles or of a ``parallelize(model, mesh)`` function in the user's project (or a file of
    it: :func:`file_plan_name`)."""
    if text in CONFIG_PLAN:
        return transformers_plan()
    if text.startswith("hf:"):
        return transformers_plan(parse_overrides(text[3:]))
    if text.startswith("zoo:"):
        return zoo_plan(text[4:])
    from shardverify.spec.allow import resolve_allowed
    project = project or Path.cwd()
    text = file_plan_name(text, project)
    found = resolve_allowed(text, project)
    if isinstance(found, Mapping):
        return styles_plan(found, text, loss_parallel)
    if callable(found):
        return function_plan(found, text, loss_parallel)
    raise InvalidArgument(f"plan {text!r} is a {type(found).__name__}: expected a dict of ParallelStyles "
                          "or a parallelize(model, mesh) function")
