"""DTensor: cumsum(x, -1) with the last dim sharded restarts the sum on every shard.
Every rank of a 2-rank mesh runs in this process (LocalTensorMode, fake process group); exit 1 while wrong."""
import sys
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
x, want = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0])      # torch.cumsum(x, -1)
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
with LocalTensorMode(2):
    got = torch.cumsum(distribute_tensor(x, init_device_mesh("cpu", (2,)), [Shard(0)]), -1).full_tensor()
dist.destroy_process_group()
for rank, value in got._local_tensors.items():
    print(f"rank {rank}: cumsum(x, -1) = {value.tolist()}, expected {want.tolist()}")
sys.exit(int(any(not torch.equal(v, want) for v in got._local_tensors.values())))
