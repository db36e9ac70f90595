"""DTensor: flatten then reshape of a tensor sharded inside the flattened dims raises a RuntimeError whose
message is '1' (a KeyError's text). Every rank of a 2-rank mesh in this process (LocalTensorMode); exit 1 while so."""
import sys
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
x = torch.arange(8.0).reshape(2, 2, 2, 1)
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
with LocalTensorMode(2):
    flat = torch.flatten(distribute_tensor(x, init_device_mesh("cpu", (2,)), [Shard(2)]), 1)   # (_StridedShard(1, sf=2),)
    try:
        _, error = flat.reshape(8), None
    except RuntimeError as exc:
        error = exc
dist.destroy_process_group()
print(f"{flat.placements} reshape(8) raises {error!r}")
sys.exit(int(error is not None and str(error).splitlines()[0] == "1"))
