"""cumsum / cumprod / logcumsumexp with a negative dim over the sharded dim.

Drop-in test for PyTorch's test/distributed/tensor/test_math_ops.py (DTensorTestBase: 2 gloo processes on CPU,
NCCL on GPUs). It fails while the bug is present (docs/upstream/cumsum-negative-dim.md)."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class DistScanNegativeDimTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 2

    @with_comms
    def test_scan_negative_dim_over_sharded_dim(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        x = torch.randn(4, 8, device=self.device_type)
        dx = distribute_tensor(x, mesh, [Shard(1)])
        for op in (torch.cumsum, torch.cumprod, torch.logcumsumexp):
            for dim in (1, -1):
                self.assertEqual(op(dx, dim).full_tensor(), op(x, dim), msg=f"{op.__name__}(x, {dim})")

if __name__ == "__main__":
    run_tests()
