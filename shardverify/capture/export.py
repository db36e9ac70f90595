"""Capture a model with ``torch.export``: the capture real models need (HF transformers'
language models cannot be symbolically traced: ``**kwargs`` forwards, control flow on shapes),
and the one PyTorch's own DTensor-based auto-parallel work uses.

The result is the exported program's training IR, un-lifted (``ExportedProgram.module()``):
ATen ops, not decomposed (``aten.linear``, ``aten.layer_norm``,
``aten.scaled_dot_product_attention`` stay whole), parameters and buffers as ``get_attr`` nodes of
the module, example inputs in their own dtypes (token ids stay int64). Every node whose value is a
tensor (or a tuple of tensors) gets ``node.meta['tensor_meta']``, as :func:`shardverify.capture.fx.trace`
gives, from the shapes export propagated, so the handlers read both graphs alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.fx import GraphModule
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from shardverify.errors import InvalidArgument

__all__ = ["export_graph", "CaptureError"]


class CaptureError(InvalidArgument):
    """The model cannot be captured with torch.export (the reason is torch's, shortened)."""


def _metadata(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return _extract_tensor_metadata(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(_extract_tensor_metadata(v) for v in value)
    return None


def export_graph(module: torch.nn.Module, args: Sequence[object] = (), kwargs: Mapping[str, object] | None = None,
                 *, strict: bool = False) -> GraphModule:
    """``torch.export.export(module, args, kwargs).module()`` with ``tensor_meta`` on every
    tensor node. ``strict=False`` (the default) traces the Python code as it runs, which HF
    models need; a model that cannot be captured raises :class:`CaptureError` naming why."""
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgument(f"export_graph() needs a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, torch.export.ExportedProgram):
        program = module
    else:
        try:
            program = torch.export.export(module, tuple(args), dict(kwargs or {}), strict=strict)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds; the user needs the reason
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CaptureError(f"torch.export cannot capture {type(module).__name__}: "
                               f"{type(exc).__name__}: {first}") from exc
    return annotate(program.module())


def annotate(graph_module: GraphModule) -> GraphModule:
    """Fill ``tensor_meta`` from export's ``val`` on every node that has one (a graph module a
    user exported with torch.export is annotated as it is, not captured again)."""
    for node in graph_module.graph.nodes:
        if "tensor_meta" not in node.meta and "val" in node.meta:
            found = _metadata(node.meta["val"])
            if found is not None:
                node.meta["tensor_meta"] = found
    return graph_module
