import pytest
import torch

from shardverify import InvalidArgument, trace


class LinearSum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 32)

    def forward(self, input, scale=2.0):
        return self.linear(input).sum(dim=(0, 2)) * scale


def test_every_node_gets_its_shape_from_meta_tensors():
    module = LinearSum()
    gm = trace(module, meta_args={"input": torch.empty(4, 4, 4, 16, device="meta")})
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes if "tensor_meta" in n.meta}
    assert shapes["input_1"] == (4, 4, 4, 16)
    assert shapes["linear"] == (4, 4, 4, 32)
    assert shapes["sum_1"] == (4, 32)
    # parameters stay real (the verifier needs their values), nothing was moved to meta
    assert gm.linear.weight.device.type == "cpu"
    assert torch.equal(gm.linear.weight, module.linear.weight)


def test_huge_inputs_allocate_nothing():
    # 2**40 floats would be 4 TiB if any activation were real
    gm = trace(torch.nn.Sequential(torch.nn.Linear(16, 8)), meta_args={"input": torch.empty(2 ** 36, 16, device="meta")})
    out = [n for n in gm.graph.nodes if n.op == "call_module"][0]
    assert tuple(out.meta["tensor_meta"].shape) == (2 ** 36, 8)


def test_real_tensors_are_accepted_as_shape_examples():
    gm = trace(torch.nn.Sequential(torch.nn.Linear(16, 8)), meta_args={"input": torch.ones(3, 16)})
    assert tuple(list(gm.graph.nodes)[1].meta["tensor_meta"].shape) == (3, 8)


def test_bad_meta_args_are_named():
    with pytest.raises(InvalidArgument, match="'x'"):
        trace(LinearSum(), meta_args={"input": torch.empty(2, 16, device="meta"), "x": torch.empty(1)})
    with pytest.raises(InvalidArgument, match="missing forward argument 'input'"):
        trace(LinearSum(), meta_args={})
    with pytest.raises(InvalidArgument, match="must be a tensor"):
        trace(LinearSum(), meta_args={"input": [1, 2]})
    with pytest.raises(InvalidArgument, match="torch.nn.Module"):
        trace(lambda x: x, meta_args={})


def test_modules_built_on_meta_trace_too():
    # a 2**34-float weight (64 GiB if real) that only exists as meta
    module = torch.nn.Sequential(torch.nn.Linear(2 ** 17, 2 ** 17, device="meta"))
    gm = trace(module, meta_args={"input": torch.empty(2, 2 ** 17, device="meta")})
    assert tuple(list(gm.graph.nodes)[1].meta["tensor_meta"].shape) == (2, 2 ** 17)


def test_buffers_and_parameters_of_the_original_are_untouched():
    module = torch.nn.Sequential(torch.nn.BatchNorm1d(4))
    gm = trace(module, meta_args={"input": torch.empty(3, 4, device="meta")})
    assert gm.get_buffer("0.running_mean").device.type == "cpu"
    assert tuple(list(gm.graph.nodes)[1].meta["tensor_meta"].shape) == (3, 4)


def test_tracing_processes_make_no_multiprocessing_lock(monkeypatch):
    """torch.fx's Interpreter opens a (disabled) tqdm bar on every run, and tqdm's default global
    lock is a multiprocessing RLock: a named semaphore that a `verify --jobs` worker stopped by
    SIGTERM left to the resource tracker ("2 leaked semaphore objects"). After quiet_tracing(),
    as every checking process calls it, no such lock is made."""
    import multiprocessing.synchronize as synchronize

    from shardverify.cli.verify_rows import quiet_tracing

    tqdm_std = pytest.importorskip("tqdm.std")
    monkeypatch.delattr(tqdm_std.tqdm, "_lock", raising=False)            # as in a fresh process
    monkeypatch.delattr(tqdm_std.TqdmDefaultWriteLock, "mp_lock", raising=False)
    made = []
    init = synchronize.SemLock.__init__

    def recording_init(self, *args, **kwargs):
        made.append(args)
        init(self, *args, **kwargs)

    monkeypatch.setattr(synchronize.SemLock, "__init__", recording_init)
    quiet_tracing()
    graph_module = torch.fx.symbolic_trace(torch.nn.ReLU())
    torch.fx.Interpreter(graph_module).run(torch.ones(2))
    assert made == []


def test_a_device_given_as_text_and_positional_flags_are_traced_and_served():
    """``x.to('cpu', torch.float64, True, True)``: the device spelled as text moves to meta for the
    shape propagation as a torch.device does; the call is then served (verified where it is met)."""
    from shardverify import DeviceMesh, strategies_for_node
    from shardverify.verify.on_demand import OnDemandVerifier

    class Cast(torch.nn.Module):
        def forward(self, x):
            return x.to("cpu", torch.float64, True, True)

    graph_module = trace(Cast(), {"x": torch.randn(4, 6)})
    node = next(n for n in graph_module.graph.nodes if n.op == "call_method")
    assert node.meta["tensor_meta"].dtype == torch.float64 and tuple(node.meta["tensor_meta"].shape) == (4, 6)
    with OnDemandVerifier(cache_dir=None) as verifier:
        served = strategies_for_node(graph_module, node.name, DeviceMesh((2, 2)), on_demand=verifier)
    assert any("S" in s.name for s in served)


class Nonzero(torch.nn.Module):
    def forward(self, x):
        return torch.nonzero(x).sum(dim=0)


def test_a_shape_that_depends_on_the_values_is_propagated_from_real_inputs_given():
    """Meta tensors cannot say how many elements are nonzero; the real inputs given can (run on a
    copy: the caller's tensors are left as they were). Meta inputs cannot, and the error says so."""
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 0.0]])
    gm = trace(Nonzero(), meta_args={"x": x})
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in gm.graph.nodes if "tensor_meta" in n.meta}
    assert shapes["nonzero"] == (2, 2) and shapes["sum_1"] == (2,)
    assert torch.equal(x, torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(Exception, match="nonzero"):
        trace(Nonzero(), meta_args={"x": torch.empty(3, 2, device="meta")})


def test_a_torch_level_call_is_named_as_a_user_writes_it():
    from torch import fx

    from shardverify.capture.call import target_name

    graph = fx.Graph()
    x = graph.placeholder("x")
    names = [target_name(graph.call_function(f, (x,))) for f in
             (torch.cov, torch.linalg.lstsq, torch.special.erfcx, torch.fft.fft, torch.nn.functional.gelu,
              torch.ops.aten._batch_norm_with_update, torch.ops.aten.add.Tensor)]
    assert names == ["torch.cov", "torch.linalg.lstsq", "torch.special.erfcx", "torch.fft.fft",
                     "torch.nn.functional.gelu", "aten._batch_norm_with_update", "aten.add.Tensor"]
