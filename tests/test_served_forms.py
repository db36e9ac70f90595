"""Forms of a call that a spec's rule once refused, served by the spec's own rule: repeat_interleave
along any dim (``first_dim_param``), index ops of 0-d tensors (``zero_dim_as_1d``), cross entropy per
sample, summed and with class weights, and torch.scatter with a reduce (a spec per form, bound to
its parameter's values). Each is served by the grid (nothing left to verify at the call), holds a
sharded layout where one exists, and every strategy it offers passes at the very call; a planted
wrong variant of each rule fails there."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp

from shardverify import DeviceMesh
from shardverify.errors import ShardVerifyError
from shardverify.spec.catalogue import load_op_specs
from shardverify.strategies.for_node import strategies_for_node
from shardverify.strategies.handlers.base import register_handler, registered_handlers, unregister_handler
from shardverify.strategies.rules.sources import parse_rule
from shardverify.verify.on_demand import OnDemandVerifier, verify_node

F = torch.nn.functional
MESHES = ((2, 2), (4,))


def _ids(*shape: int, high: int = 4) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(0))


def _data(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


@dataclasses.dataclass(frozen=True)
class Form:
    fn: Callable[..., torch.Tensor]
    values: tuple[torch.Tensor, ...]
    spec: str                 # the handler that serves it
    sharded: bool             # some layout of it shards a dim


FORMS = {
    "repeat_interleave dim -1": Form(lambda x: x.repeat_interleave(2, dim=-1), (_data(4, 6),),
                                     "repeat_interleave", True),
    "repeat_interleave dim 1": Form(lambda x: torch.repeat_interleave(x, 3, dim=1), (_data(4, 6, 2),),
                                    "repeat_interleave", True),
    "repeat_interleave flattened": Form(lambda x: x.repeat_interleave(2), (_data(4, 6),), "repeat_interleave", True),
    "index_select 0-d input": Form(lambda x, i: torch.index_select(x, 0, i), (_data(), _ids(1, high=1)),
                                   "index_select", False),
    "index_select 0-d id": Form(lambda x, i: torch.index_select(x, 0, i), (_data(8, 4), _ids(high=8)),
                                "index_select", True),
    "index_add 0-d": Form(lambda x, i, s: x.index_add(0, i, s), (_data(), _ids(1, high=1), _data()),
                          "index_add", False),
    "cross_entropy none": Form(lambda x, t: F.cross_entropy(x, t, reduction="none"), (_data(4, 5), _ids(4)),
                               "cross_entropy_none", True),
    "cross_entropy none weighted": Form(lambda x, t, w: F.cross_entropy(x, t, weight=w, reduction="none"),
                                        (_data(4, 5), _ids(4), _data(5).abs()), "cross_entropy_none", True),
    "cross_entropy sum weighted": Form(lambda x, t, w: F.cross_entropy(x, t, weight=w, reduction="sum"),
                                       (_data(4, 5), _ids(4), _data(5).abs()), "cross_entropy_sum", True),
    "cross_entropy mean weighted": Form(lambda x, t, w: F.cross_entropy(x, t, weight=w),
                                        (_data(4, 5), _ids(4), _data(5).abs()), "cross_entropy_weighted", False),
    "scatter add": Form(lambda x, i, s: torch.scatter(x, 1, i, s, reduce="add"), (_data(4, 6), _ids(4, 6), _data(4, 6)),
                        "scatter_accumulate", True),
    "scatter multiply": Form(lambda x, i, s: x.scatter(1, i, s, reduce="multiply"),
                             (_data(4, 6), _ids(4, 6), _data(4, 6)), "scatter_multiply", True),
    "scatter value add": Form(lambda x, i: torch.scatter(x, 1, i, 2.5, reduce="add"), (_data(4, 6), _ids(4, 6)),
                              "scatter_value_accumulate", True),
    "scatter value multiply": Form(lambda x, i: x.scatter(1, i, 2.5, reduce="multiply"), (_data(4, 6), _ids(4, 6)),
                                   "scatter_value_multiply", True),
}


def _captured(fn: Callable[..., torch.Tensor], values: tuple[torch.Tensor, ...]) -> tuple[fx.GraphModule, fx.Node]:
    """``fn`` captured by torch.fx.symbolic_trace with the shapes ShapeProp records, and its op node."""
    names = ", ".join(f"x{i}" for i in range(len(values)))
    namespace: dict = {"fn": fn}
    exec(f"def forward(self, {names}):\n    return fn({names})\n", namespace)   # noqa: S102
    graph_module = fx.symbolic_trace(type("Call", (torch.nn.Module,), {"forward": namespace["forward"]})())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # torch.scatter's reduce= is deprecated
        ShapeProp(graph_module).propagate(*values)
    node = next(n for n in graph_module.graph.nodes if n.op in ("call_function", "call_method"))
    return graph_module, node


def _sharded(strategy) -> bool:
    return any(spec.dim_partition for _, spec in strategy.sharding_specs)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("name", sorted(FORMS))
def test_a_form_is_served_by_its_spec_grid_and_holds_at_the_call(name, mesh):
    form = FORMS[name]
    graph_module, node = _captured(form.fn, form.values)
    with OnDemandVerifier(cache_dir=None) as verifier:
        served = strategies_for_node(graph_module, node.name, DeviceMesh(mesh), on_demand=verifier)
    assert not verifier.records, "served by its spec's grid: nothing verified on demand"
    assert served and any(_sharded(s) for s in served) == form.sharded, [s.name for s in served]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = verify_node(graph_module, node, mesh)
    assert {r.op for r in results} == {form.spec}
    assert results and all(r.passed for r in results), [r.strategy for r in results if not r.passed]


def test_dim_0_keeps_the_rule_as_written():
    """Along dim 0 nothing moves: the names and order the rule always gave."""
    graph_module, node = _captured(lambda x: x.repeat_interleave(2, dim=0), (_data(4, 6),))
    names = [s.name for s in strategies_for_node(graph_module, node.name, DeviceMesh((2, 2)))]
    assert names[0] == "S1R -> S1R" and "S0S1 -> S0S1" in names and names[-1] == "RR -> RR"


@contextmanager
def _planted(name: str, **options: object) -> Iterator[None]:
    """The shipped handler ``name`` replaced by one whose rule has ``options`` in place of its own
    (a value of None drops the option)."""
    shipped = registered_handlers()[name]
    spec, = load_op_specs(Path(__file__).resolve().parents[1], None, [name])
    kept = {key: value for key, value in spec.options if key not in options}
    changed = kept | {k: v for k, v in options.items() if v is not None}
    unregister_handler(name)
    register_handler(dataclasses.replace(shipped, rule=parse_rule(changed), spec_file=f"specs/planted_{name}.yaml"))
    try:
        yield
    finally:
        unregister_handler(name)
        register_handler(shipped)


def _failed(fn, values, mesh=(2, 2)) -> list[str]:
    graph_module, node = _captured(fn, values)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [r.strategy for r in verify_node(graph_module, node, mesh) if not r.passed]


def test_repeat_interleave_applied_at_the_wrong_dim_fails():
    """Output copies placed at the last dim while the call repeats dim 0: a [6, 12] input gives a
    [12, 12] output, so the rule binds, and its row shards become the output's column shards."""
    call = (lambda x: x.repeat_interleave(2, dim=0), (_data(6, 12),))
    assert not _failed(*call)
    with _planted("repeat_interleave", einsum="n ... -> ... (n r)"):
        assert "S0R -> RS0" in _failed(*call)


def test_a_rule_read_at_the_call_dim_alone_is_refused():
    """Without first_dim_param the rule is read along dim 0 whatever the call says: it does not
    describe a call along dim -1, which is refused, never served."""
    graph_module, node = _captured(lambda x: x.repeat_interleave(2, dim=-1), (_data(4, 6),))
    with _planted("repeat_interleave", first_dim_param=None):
        with pytest.raises(ShardVerifyError, match="does not describe this call"):
            strategies_for_node(graph_module, node.name, DeviceMesh((2, 2)), on_demand=OnDemandVerifier(cache_dir=None))


def test_a_0d_id_into_a_sharded_table_without_masking_fails():
    call = (lambda x, i: torch.index_select(x, 0, i), (_data(8, 4), _ids(high=8)))
    with _planted("index_select", indices=None):
        assert "S0R x - -> RR | P0 sum" in _failed(*call)


def test_cross_entropy_with_the_classes_sharded_fails():
    call = (lambda x, t: F.cross_entropy(x, t, reduction="none"), (_data(4, 6), _ids(4)))
    with _planted("cross_entropy_none", whole=None):
        assert "RS0 x R -> R | P0 sum" in _failed(*call)


def test_a_weighted_mean_as_an_avg_of_the_shards_fails():
    call = (lambda x, t, w: F.cross_entropy(x, t, weight=w), (_data(8, 5), _ids(8), _data(5).abs() + 0.5))
    with _planted("cross_entropy_weighted", whole=("c",), reduce=(("n", "avg"),)):
        assert "S0R x S0 x R -> - | P0 avg" in _failed(*call)


def test_scatter_multiply_linear_in_its_source_fails():
    call = (lambda x, i, s: torch.scatter(x, 1, i, s, reduce="multiply"), (_data(4, 6), _ids(4, 6), _data(4, 6)))
    with _planted("scatter_multiply", linear_in=(("input", "src"),)):
        assert "RR+P0 x RR x RR+P0 -> RR | P0 sum" in _failed(*call)
