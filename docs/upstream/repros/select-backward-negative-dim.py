"""DTensor: the gradient of select(x, -1, i) comes back sharded on the wrong dim (wrong values).
Every rank of a 2-rank mesh in this process (LocalTensorMode, fake process group); exit 1 while wrong."""
import sys
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
x = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])                       # (1, 2, 2): 1 row of dim 1 per rank
want = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])                    # d select(x, -1, -1).sum() / dx
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
with LocalTensorMode(2):
    dx = distribute_tensor(x, init_device_mesh("cpu", (2,)), [Shard(1)]).requires_grad_()
    dx.select(-1, -1).full_tensor().sum().backward()
    got = dx.grad.full_tensor()
dist.destroy_process_group()
for rank, value in got._local_tensors.items():
    print(f"rank {rank}: grad {dx.grad.placements} = {value.tolist()}, expected {want.tolist()}")
sys.exit(int(any(v.shape != want.shape or not torch.equal(v, want) for v in got._local_tensors.values())))
