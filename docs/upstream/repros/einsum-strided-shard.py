"""DTensor: einsum with an operand held as [_StridedShard(1, sf=2), Shard(1)] (the shard order FSDP2 over TP
on one dim gives) computes wrong values. Every rank of a 2x2 mesh in this process (LocalTensorMode); exit 1 while wrong."""
import torch
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
a, b = torch.arange(8.0).reshape(2, 1, 4), torch.arange(8.0).reshape(2, 4, 1)
want = torch.einsum("bij,bjk->ik", a, b)
torch.distributed.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
with LocalTensorMode(4):   # j cut in halves by mesh axis 1, each half in two by axis 0: rank (i0, i1) holds j = 2 * i1 + i0
    blocks = LocalTensor({2 * i0 + i1: b[:, [2 * i1 + i0]] for i0 in (0, 1) for i1 in (0, 1)})
    strided = torch.distributed.tensor.placement_types._StridedShard(1, split_factor=2)   # a private class
    db = DTensor.from_local(blocks, mesh := init_device_mesh("cpu", (2, 2)), [strided, Shard(1)], run_check=False,
                            shape=b.shape, stride=b.stride())
    print("b reads back:", all(torch.equal(v, b) for v in db.full_tensor()._local_tensors.values()))
    got = torch.einsum("bij,bjk->ik", distribute_tensor(a, mesh, [Replicate(), Replicate()]), db).full_tensor()
torch.distributed.destroy_process_group()
print({r: v.flatten().tolist() for r, v in got._local_tensors.items()}, "expected", want.flatten().tolist())
raise SystemExit(int(any(not torch.equal(v, want) for v in got._local_tensors.values())))
