"""conv2d with the weight sharded on its output channels or partial: the handler must apply the\nredistribution its own rule asks for.

Drop-in test for PyTorch's test/distributed/tensor/test_convolution_ops.py (DTensorTestBase: 2 gloo processes on CPU,
NCCL on GPUs). It fails while the bug is present (docs/upstream/conv2d-runtime-redistribution.md)."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class DistConvolutionRedistributeTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 2

    @with_comms
    def test_conv2d_weight_needs_redistribution(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        x = torch.randn(2, 3, 6, 6, device=self.device_type)
        w = torch.randn(4, 3, 3, 3, device=self.device_type)
        dx = distribute_tensor(x, mesh, [Replicate()])
        for placements in ([Shard(0)], [Partial()]):
            dw = distribute_tensor(w, mesh, [Replicate()]).redistribute(mesh, placements)
            out = torch.nn.functional.conv2d(dx, dw)
            self.assertEqual(out.full_tensor(), torch.nn.functional.conv2d(x, w), msg=str(placements))

if __name__ == "__main__":
    run_tests()
