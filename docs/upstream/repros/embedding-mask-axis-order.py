"""DTensor: embedding with the table's rows sharded on mesh axis 0 and the ids on axis 1 returns an
output whose full_tensor() raises. Every rank of a 2x2 mesh in this process (LocalTensorMode); exit 1 while so."""
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
ids, table = torch.tensor([[0], [1]]), torch.tensor([[1.0], [2.0]])
dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
with LocalTensorMode(4):
    out = torch.nn.functional.embedding(distribute_tensor(ids, mesh := init_device_mesh("cpu", (2, 2)), [Replicate(), Shard(0)]),
                                        distribute_tensor(table, mesh, [Shard(0), Replicate()]))
    try:
        _, error = out.full_tensor(), None
    except IndexError as exc:
        error = exc
dist.destroy_process_group()
print(f"output placements {out.placements}; full_tensor() raises {error!r}")
raise SystemExit(int(isinstance(error, IndexError)))
