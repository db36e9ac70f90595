"""What a captured node says it returns: shape propagation (fx's ShapeProp, export's fake values)
leaves ``node.meta["tensor_meta"]`` as one ``TensorMetadata`` for a tensor, a tuple or list of
them for a tuple result (an element that is no tensor left as it is), or nothing. Every reader
goes through these two functions, so "one tensor or a tuple" is told apart in one place."""

from __future__ import annotations

from torch import fx

__all__ = ["output_metas", "tensor_meta"]


def tensor_meta(node: fx.Node) -> object | None:
    """The node's ``TensorMetadata`` when it returns a single tensor, else None."""
    meta = node.meta.get("tensor_meta")
    return meta if hasattr(meta, "shape") else None


def output_metas(node: fx.Node) -> tuple | None:
    """The ``TensorMetadata`` of each value the node returns: one for a tensor, one per element
    of a tuple result (None for an element that is no tensor); None when shape propagation
    recorded no tensor for the node."""
    meta = node.meta.get("tensor_meta")
    if hasattr(meta, "shape"):
        return (meta,)
    if isinstance(meta, (list, tuple)):
        return tuple(m if hasattr(m, "shape") else None for m in meta)
    return None
