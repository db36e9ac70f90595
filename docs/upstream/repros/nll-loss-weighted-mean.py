"""DTensor: cross_entropy(x, t, weight=w) with the batch sharded averages the shards' weighted means.
Every rank of a 2-rank mesh runs in this process (LocalTensorMode, fake process group); exit 1 while wrong."""
import sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
x, t, w = torch.tensor([[2.0, 0.0], [0.0, 0.0]]), torch.tensor([0, 1]), torch.tensor([1.0, 3.0])
want = F.cross_entropy(x, t, weight=w)                  # sum(w[t] * loss) / sum(w[t]) = 0.5516
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
with LocalTensorMode(2):
    mesh = init_device_mesh("cpu", (2,))
    got = F.cross_entropy(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(t, mesh, [Shard(0)]),
                          weight=distribute_tensor(w, mesh, [Replicate()])).full_tensor()
dist.destroy_process_group()
print("\n".join(f"rank {r}: loss = {v.item():.4f}, expected {want.item():.4f}" for r, v in got._local_tensors.items()))
sys.exit(int(any(not torch.allclose(v, want) for v in got._local_tensors.values())))
