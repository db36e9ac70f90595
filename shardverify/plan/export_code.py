"""A :class:`~shardverify.plan.export.ParallelizeExport` written as a Python file: a dict ``PLAN`` of module
name to ParallelStyle and a ``parallelize(model, mesh)`` function that applies it with
``parallelize_module`` on the tensor-parallel axis and data parallelism (``replicate``: weights whole,
gradients summed over the axis) on each data-parallel axis. The file is data written as code: every name
and reason is written with ``repr``, so no text of a model (a module's name, a reason quoting it) is ever
pasted into the code unescaped; the nodes no style expresses are listed in a comment and in
``NOT_EXPRESSED``."""

from __future__ import annotations

from shardverify.plan.export import ModuleStyle, ParallelizeExport

__all__ = ["render_parallelize", "export_summary"]

_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel", "sequence": "SequenceParallel"}

_FUNCTION = '''

def _axis_mesh(mesh, axis):
    """The 1-D mesh of one axis of ``mesh`` (the mesh itself when it has one axis)."""
    return mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[axis]]


def parallelize(model, mesh):
    """Apply the plan to ``model`` on ``mesh``, a DeviceMesh of MESH_SHAPE with named axes."""
    if tuple(mesh.shape) != MESH_SHAPE:
        raise ValueError(f"this plan was solved for a mesh of shape {MESH_SHAPE}, not {tuple(mesh.shape)}")
    if PLAN:
        parallelize_module(model, _axis_mesh(mesh, TENSOR_PARALLEL_AXIS), PLAN)
    for axis in DATA_PARALLEL_AXES:
        from torch.distributed._composable.replicate import replicate

        replicate(model, device_mesh=_axis_mesh(mesh, axis))
    return model
'''


def _style(style: ModuleStyle) -> str:
    if style.style == "sequence":
        return f"SequenceParallel(sequence_dim={int(style.sequence_dim)}, use_local_output=True)"
    return (f"{_STYLES[style.style]}(input_layouts={style.input_layout}, "
            f"output_layouts={style.output_layout}, use_local_output=True)")


def render_parallelize(export: ParallelizeExport, source: str) -> str:
    """The Python file; ``source``: what the plan was solved for (written with repr, in a comment)."""
    lines = ["# A PyTorch parallelize plan exported by `shardverify plan --export-parallelize` from the plan solved",
             f"# for {source!r} on mesh {list(export.mesh_shape)}.",
             "# Check it against the single-device model: shardverify parallelize MODEL --plan THIS_FILE.py",
             "# Tensor parallel on mesh axis TENSOR_PARALLEL_AXIS (PLAN's ParallelStyles); data parallel on each of",
             "# DATA_PARALLEL_AXES (the batch split, every weight whole: each rank takes its own rows of the batch).",
             ""]
    if export.inexpressible:
        lines.append("# NOT EXPRESSED: the plan's layout here has no ParallelStyle, so this file does not do what the")
        lines.append("# plan does there (see NOT_EXPRESSED):")
        lines += [f"#   {item.where!r}: {item.reason!r}" for item in export.inexpressible]
        lines.append("")
    lines += ["from torch.distributed.tensor import Partial, Replicate, Shard",
              "from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,",
              "                                               parallelize_module)",
              "",
              f"MESH_SHAPE = {tuple(int(n) for n in export.mesh_shape)!r}",
              f"TENSOR_PARALLEL_AXIS = {export.tp_axis if export.tp_axis is None else int(export.tp_axis)!r}",
              f"DATA_PARALLEL_AXES = {tuple(int(a) for a in export.data_parallel_axes)!r}",
              "",
              "#: module name -> ParallelStyle (the plan's nodes each entry stands for in its comment)",
              "PLAN = {"]
    for style in export.styles:
        lines.append(f"    {style.module!r}: {_style(style)},  # nodes {', '.join(map(repr, style.nodes))}")
    lines += ["}", "", "#: (node, module or mesh axis; why no ParallelStyle does what the plan does there)",
              "NOT_EXPRESSED = ("]
    lines += [f"    ({item.where!r}, {item.reason!r})," for item in export.inexpressible]
    lines.append(")")
    return "\n".join(lines) + "\n" + _FUNCTION


def export_summary(export: ParallelizeExport, path: str) -> list[str]:
    """What the export wrote, for stderr: one line, then each node no style expresses."""
    dp = f"; data parallel over mesh axis(es) {list(export.data_parallel_axes)}" if export.data_parallel_axes else ""
    tp = "" if export.tp_axis is None else f" on mesh axis {export.tp_axis}"
    lines = [f"exported the plan to {path}: {len(export.styles)} module(s) as ParallelStyles{tp}{dp}; "
             f"{len(export.inexpressible)} not expressible"]
    lines += [f"  not expressible: {item.where}: {item.reason}" for item in export.inexpressible]
    return lines
