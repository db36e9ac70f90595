"""The gradient of flatten over a dim sharded on both mesh axes, read through full_tensor().

Drop-in test for PyTorch's test/distributed/tensor/test_view_ops.py (DTensorTestBase: 4 gloo processes on CPU,
NCCL on GPUs). It fails while the bug is present (docs/upstream/flatten-backward.md)."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class DistFlattenBackwardTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_flatten_backward_dim_sharded_on_both_axes(self):
        mesh = init_device_mesh(self.device_type, (2, 2))
        x = torch.randn(2, 2, 4, 4, device=self.device_type, requires_grad=True)
        weights = torch.randn(2, 32, device=self.device_type)
        (torch.flatten(x, 1) * weights).sum().backward()
        dx = distribute_tensor(x.detach(), mesh, [Shard(2), Shard(2)]).requires_grad_()
        (torch.flatten(dx, 1).full_tensor() * weights).sum().backward()
        self.assertEqual(dx.grad.full_tensor(), x.grad)

if __name__ == "__main__":
    run_tests()
