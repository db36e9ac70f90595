"""DTensor: conv2d with the weight sharded on its output channels returns each rank's channels
alone, labelled Replicate. Every rank of a 2-rank mesh in this process (LocalTensorMode); exit 1 while wrong."""
import sys
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
x, w = torch.ones(1, 1, 1, 1), torch.tensor([1.0, 2.0]).reshape(2, 1, 1, 1)
want = torch.nn.functional.conv2d(x, w)                            # [1, 2], shape (1, 2, 1, 1)
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
with LocalTensorMode(2):
    mesh = init_device_mesh("cpu", (2,))
    out = torch.nn.functional.conv2d(distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(w, mesh, [Shard(0)]))
    got = out.full_tensor()
dist.destroy_process_group()
for rank, v in got._local_tensors.items():
    print(f"rank {rank}: {out.placements} output {v.flatten().tolist()} shape {tuple(v.shape)}, expected [1.0, 2.0]")
sys.exit(int(any(v.shape != want.shape or not torch.equal(v, want) for v in got._local_tensors.values())))
