"""einsum with an operand in the layout FSDP2 over tensor parallelism on the same dim gives\n(_StridedShard on the FSDP axis, Shard on the TP axis).

Drop-in test for PyTorch's test/distributed/tensor/test_matrix_ops.py (DTensorTestBase: 4 gloo processes on CPU,
NCCL on GPUs). It fails while the bug is present (docs/upstream/einsum-strided-shard.md)."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class DistEinsumStridedShardTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_einsum_strided_shard_operand(self):
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh = init_device_mesh(self.device_type, (2, 2))
        a = torch.randn(4, 8, 8, device=self.device_type)
        b = torch.randn(4, 8, 8, device=self.device_type)
        # dim 1 of b cut in halves by mesh axis 1, then each half in two by axis 0
        i0, i1 = mesh.get_coordinate()
        local = b[:, 4 * i1 + 2 * i0: 4 * i1 + 2 * i0 + 2].contiguous()
        db = DTensor.from_local(local, mesh, [_StridedShard(1, split_factor=2), Shard(1)], shape=b.shape, stride=b.stride())
        self.assertEqual(db.full_tensor(), b)
        da = distribute_tensor(a, mesh, [Shard(0), Replicate()])
        self.assertEqual(torch.einsum("bij,bjk->ik", da, db).full_tensor(), torch.einsum("bij,bjk->ik", a, b))

if __name__ == "__main__":
    run_tests()
