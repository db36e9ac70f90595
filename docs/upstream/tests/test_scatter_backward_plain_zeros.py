"""The backward of select_scatter / slice_scatter on DTensors (replicated included).

Drop-in test for PyTorch's test/distributed/tensor/test_tensor_ops.py (DTensorTestBase: 2 gloo processes on CPU,
NCCL on GPUs). It fails while the bug is present (docs/upstream/scatter-backward-plain-zeros.md)."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class DistScatterBackwardTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 2

    @with_comms
    def test_select_and_slice_scatter_backward(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        x = torch.randn(4, 6, device=self.device_type)
        calls = [(lambda a, b: torch.select_scatter(a, b, 1, -1), torch.randn(4, device=self.device_type)),
                 (lambda a, b: torch.slice_scatter(a, b, 1, 1, 5, 2), torch.randn(4, 2, device=self.device_type))]
        for f, src in calls:
            for placements in ([Replicate()], [Shard(0)]):
                rx, rs = x.clone().requires_grad_(), src.clone().requires_grad_()
                f(rx, rs).sum().backward()
                dx = distribute_tensor(x, mesh, placements).requires_grad_()
                ds = distribute_tensor(src, mesh, placements).requires_grad_()
                f(dx, ds).full_tensor().sum().backward()
                self.assertEqual(dx.grad.full_tensor(), rx.grad)
                self.assertEqual(ds.grad.full_tensor(), rs.grad)

if __name__ == "__main__":
    run_tests()
