"""The gradient of select(x, -1, i) with x sharded on another dim.

Drop-in test for PyTorch's test/distributed/tensor/test_tensor_ops.py (DTensorTestBase: 2 gloo processes on CPU,
NCCL on GPUs). It fails while the bug is present (docs/upstream/select-backward-negative-dim.md)."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class DistSelectBackwardNegativeDimTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 2

    @with_comms
    def test_select_negative_dim_backward(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        x = torch.randn(3, self.world_size, 5, device=self.device_type, requires_grad=True)
        x.select(-1, -1).sum().backward()
        dx = distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_()
        dx.select(-1, -1).full_tensor().sum().backward()
        self.assertEqual(dx.grad.placements, (Shard(1),))
        self.assertEqual(dx.grad.full_tensor(), x.grad)

if __name__ == "__main__":
    run_tests()
