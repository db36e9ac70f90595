"""The same verification on 4 real torch.distributed ranks (gloo on CPU): every generated
linear and sum strategy passes, every broken variant is caught with the same strategy, rank
and tensor as on the simulated mesh, and a failing rank does not stop the run.

Marked dist: runs with AUTO_PARALLEL=1. The pools come from the plugin's `sv_backend`, so
they are started once per pytest worker and shared with the generated tests.
"""

from __future__ import annotations

import pytest

from test_verify_broken import (
    LINEAR,
    SUM,
    check_caught,
    check_layout_caught,
    check_partial_sum,
    drop_required_all_reduces,
    generated,
    skip_gradient_hooks,
    wrong_mesh_axis,
    wrong_output_layout,
)

from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.verify.engine import verify_case
from shardverify.verify.report import assert_passed

pytestmark = pytest.mark.dist
MESHES = [pytest.param((2, 2), id="mesh2x2"), pytest.param((4,), id="mesh4")]


def findings(results) -> set[tuple[str, str, int, str]]:
    """What the checks found, independent of floating-point noise in the error sizes."""
    return {(r.strategy, m.tensor, m.rank, m.kind) for r in results for m in r.mismatches}


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_generated_strategies_pass_on_gloo(sv_backend, mesh_shape):
    backend = sv_backend(mesh_shape, "process")
    for case in (LINEAR, SUM):
        # A fresh worker's first check imports torch's meta kernels (seconds, more on a loaded
        # box): allow for it; a hang still ends in RankTimeout.
        results = verify_case(backend, case, timeout=180)
        assert_passed(results)
        assert {r.backend for r in results} == {"gloo"}


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_broken_variants_are_caught_on_gloo_as_on_the_simulated_mesh(sv_backend, mesh_shape):
    gloo, simulated = sv_backend(mesh_shape, "process"), sv_backend(mesh_shape, "simulated")
    linear = generated(LINEAR, gloo.mesh)
    variants = list(drop_required_all_reduces(linear)) + list(skip_gradient_hooks(linear))
    if gloo.mesh.ndim == 2:
        variants += list(wrong_mesh_axis(linear))[:2]
    assert check_caught(gloo, LINEAR, variants) > 0
    assert check_layout_caught(gloo, LINEAR, linear[:3]) > 0
    assert check_layout_caught(gloo, SUM, generated(SUM, gloo.mesh)[:3]) > 0
    check_partial_sum(gloo)
    broken = [b for b, _ in variants] + [b for b, _ in wrong_output_layout(linear[:3], gloo.mesh)]
    assert findings(verify_case(gloo, LINEAR, broken)) == findings(verify_case(simulated, LINEAR, broken))


def test_a_raising_strategy_fails_and_the_pool_goes_on(sv_backend):
    backend = sv_backend((4,), "process")
    good = generated(LINEAR, backend.mesh)
    specs = dict(good[-1].sharding_specs)   # the first shards the contracted dim already (PostAdd bias)
    specs["input_1"] = ShardingSpec.from_partition((4,), specs["input_1"].tensor_shape, {3: (0,)})
    raising = good[-1].replace(name="input split on its contracted dim", sharding_specs=tuple(specs.items()))
    results = verify_case(backend, LINEAR, [raising, good[0]])
    assert not results[0].passed and results[1].passed
    assert {m.kind for m in results[0].mismatches} == {"error"}
    assert "input split on its contracted dim" in results[0].report() and "raised" in results[0].report()
