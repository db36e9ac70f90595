"""The "reshard" spec kind: ``specs/reshard/<name>.yaml`` -> ``generated_tests/test_reshard_<name>.py``,
which checks every (source, target) layout pair of each tensor shape on one mesh, forward and
backward (pruned to one pair per symmetry orbit unless ``prune: false``)::

    name: mesh_2x2                 # required, an identifier
    description: ...
    mesh: [2, 2]                   # required
    shapes: [[8, 8], [8, 8, 8]]    # required: tensor shapes (2-D and 3-D)
    prune: true                    # one pair per orbit of mesh-axis and tensor-dim symmetries
    seed: 0
"""

from __future__ import annotations

from dataclasses import dataclass

from shardverify.spec.fields import Fields, as_identifier, as_mesh, as_shape
from shardverify.spec.kinds import TemplateRenderer
from shardverify.spec.loader import Node
from shardverify.errors import InvalidArgument, ShardingSpecError
from shardverify.features.reshard.check import check_pair_limit
from shardverify.spec.limits import tensor_size_problems
from shardverify.sharding.mesh import DeviceMesh

__all__ = ["ReshardSpec", "parse_reshard_spec", "render_reshard_spec", "summarize_reshard_spec"]


@dataclass(frozen=True)
class ReshardSpec:
    name: str
    source: str
    description: str
    mesh: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    prune: bool = True
    seed: int = 0

    def counts(self) -> list[tuple[tuple[int, ...], int, int]]:
        """(shape, pairs checked, all pairs) per shape."""
        from shardverify.features.reshard.check import pair_count

        return [(s, pair_count(self.mesh, s, self.prune), pair_count(self.mesh, s, False)) for s in self.shapes]


def parse_reshard_spec(root: Node) -> ReshardSpec:
    fields = Fields(root)
    name = as_identifier(fields.required("name", str))
    description = fields.optional("description", str)
    mesh_node = fields.required("mesh", list)
    mesh = as_mesh(mesh_node)
    shapes_node = fields.required("shapes", list)
    shapes = tuple(as_shape(item, allow_empty=False) for item in shapes_node.value)  # type: ignore[union-attr]
    if not shapes:
        raise shapes_node.error("list at least one tensor shape")
    prune_node = fields.optional("prune", bool)
    seed_node = fields.optional("seed", int)
    fields.finish()
    try:
        DeviceMesh(mesh)
    except ShardingSpecError as error:   # pragma: no cover - as_shape already refuses bad sizes
        raise mesh_node.error(str(error)) from None
    problems = tensor_size_problems([(f"shape {i}", shape) for i, shape in enumerate(shapes)])
    if problems:
        raise shapes_node.error("; ".join(problems))
    for item, shape in zip(shapes_node.value, shapes):  # type: ignore[arg-type]
        try:
            check_pair_limit(mesh, shape)
        except InvalidArgument as error:
            raise item.error(str(error)) from None
    seed = 0 if seed_node is None else int(seed_node.value)  # type: ignore[arg-type]
    if seed < 0:
        raise seed_node.error(f"expected a seed >= 0, got {seed}")  # type: ignore[union-attr]
    return ReshardSpec(name, root.file, "" if description is None else str(description.value), mesh, shapes,
                       True if prune_node is None else bool(prune_node.value), seed)


def render_reshard_spec(spec: ReshardSpec, renderer: TemplateRenderer) -> dict[str, str]:
    counts = spec.counts()
    text = renderer.render("reshard_test.py.j2", spec=spec, counts=counts, counts_only=tuple(n for _, n, _ in counts))
    return {f"generated_tests/test_reshard_{spec.name}.py": text}


def summarize_reshard_spec(spec: ReshardSpec) -> dict[str, str]:
    return {"mesh": str(list(spec.mesh)),
            "pairs": ", ".join(f"{list(s)}: {n}/{total}" for s, n, total in spec.counts())}
