"""A view of a _StridedShard tensor: flatten of a dim sharded on both mesh axes, viewed back.

Drop-in test for PyTorch's test/distributed/tensor/test_view_ops.py (DTensorTestBase: 4 gloo processes on CPU,
NCCL on GPUs). It fails while the bug is present (docs/upstream/view-strided-shard.md)."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class DistViewStridedShardTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_flatten_then_view_back_dim_sharded_on_both_axes(self):
        mesh = init_device_mesh(self.device_type, (2, 2))
        x = torch.randn(2, 2, 4, 4, device=self.device_type)
        flat = torch.flatten(distribute_tensor(x, mesh, [Shard(2), Shard(2)]), 1)
        self.assertEqual(flat.full_tensor(), x.flatten(1))
        self.assertEqual(flat.view(x.shape).full_tensor(), x)

if __name__ == "__main__":
    run_tests()
