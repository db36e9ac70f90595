"""DTensor: flatten of a dim sharded on both mesh axes, viewed back to its shape, gives permuted
values. Every rank of a 2x2 mesh in this process (LocalTensorMode, fake process group); exit 1 while wrong."""
import sys
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
x = torch.arange(32.0).reshape(1, 2, 4, 4)
dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
with LocalTensorMode(4):
    dx = distribute_tensor(x, init_device_mesh("cpu", (2, 2)), [Shard(2), Shard(2)])
    flat = torch.flatten(dx, 1)                                    # right: (_StridedShard(1, sf=4), ...)
    out = flat.view(x.shape)                                       # wrong placements for the data
    got = out.full_tensor()
dist.destroy_process_group()
for rank, value in got._local_tensors.items():
    print(f"rank {rank}: {flat.placements} -> {out.placements}: max error {(value - x).abs().max().item()}")
sys.exit(int(any(not torch.equal(v, x) for v in got._local_tensors.values())))
