"""capture.fx.trace: shapes on every node from meta tensors, the module's own weights untouched,
and a module holding no weight run as it is (no copy of its GraphModule)."""

from __future__ import annotations

import torch
from torch import fx, nn

from shardverify.capture import fx as capture_fx
from shardverify.capture.fx import trace


def _metas(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    return {n.name: tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes if "tensor_meta" in n.meta}


def test_a_module_without_weights_gets_its_shapes_without_a_copy(monkeypatch):
    gm = fx.symbolic_trace(lambda x, y: torch.matmul(x, y).relu())
    code = gm.code

    def no_copy(*args, **kwargs):
        raise AssertionError("a module without weights was copied")

    monkeypatch.setattr(capture_fx.copy, "deepcopy", no_copy)
    traced = trace(gm, {"x": torch.empty(4, 3, device="meta"), "y": torch.empty(3, 5, device="meta")})
    assert traced is gm and gm.code == code
    assert _metas(gm) == {"x": (4, 3), "y": (3, 5), "matmul": (4, 5), "relu": (4, 5), "output": (4, 5)}


def test_a_module_with_weights_is_shaped_on_a_meta_copy_its_weights_untouched():
    torch.manual_seed(0)
    model = fx.symbolic_trace(nn.Sequential(nn.Linear(3, 5), nn.ReLU()))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    traced = trace(model, {"input": torch.empty(4, 3, device="meta")})
    assert traced is model
    assert _metas(model)["_0"] == (4, 5) and _metas(model)["_1"] == (4, 5)
    after = model.state_dict()
    assert all(not t.is_meta and torch.equal(t, before[name]) for name, t in after.items())
