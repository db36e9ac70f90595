"""DTensor: the backward of select_scatter raises "got mixed torch.Tensor and DTensor", replicated
inputs included. Every rank of a 2-rank mesh in this process (LocalTensorMode); exit 1 while so."""
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
x, v = torch.zeros(2, 2), torch.ones(2)                            # src of 2 elements: not a scalar
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
with LocalTensorMode(2):
    dx = distribute_tensor(x, mesh := init_device_mesh("cpu", (2,)), [Replicate()]).requires_grad_()
    out = torch.select_scatter(dx, distribute_tensor(v, mesh, [Replicate()]), 1, -1)   # forward: right
    try:
        error = out.full_tensor().sum().backward()                # None once the backward runs
    except RuntimeError as exc:
        error = exc
dist.destroy_process_group()
print(f"backward of select_scatter raises {error!r}" if error else f"grad of x: {dx.grad.placements}")
raise SystemExit(int(error is not None))
