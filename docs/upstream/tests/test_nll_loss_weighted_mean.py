"""cross_entropy / nll_loss with reduction='mean' over a sharded batch whose shards' total weights differ.

Drop-in test for PyTorch's test/distributed/tensor/test_math_ops.py (DTensorTestBase: 2 gloo processes on CPU,
NCCL on GPUs). It fails while the bug is present (docs/upstream/nll-loss-weighted-mean.md)."""

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class DistNllLossMeanTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 2

    def _batch(self):
        torch.manual_seed(0)
        x = torch.randn(8, 5, device=self.device_type)
        t = torch.randint(0, 5, (8,), device=self.device_type)
        return x, t

    @with_comms
    def test_weighted_mean_over_sharded_batch(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        x, t = self._batch()
        w = torch.linspace(0.5, 2.0, 5, device=self.device_type)
        dx, dt = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(t, mesh, [Shard(0)])
        dw = distribute_tensor(w, mesh, [Replicate()])
        self.assertEqual(F.cross_entropy(dx, dt, weight=dw).full_tensor(), F.cross_entropy(x, t, weight=w))
        self.assertEqual(F.nll_loss(dx.log_softmax(1), dt, weight=dw).full_tensor(),
                         F.nll_loss(x.log_softmax(1), t, weight=w))

    @with_comms
    def test_mean_with_ignored_targets_over_sharded_batch(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        x, t = self._batch()
        t[:3] = -100     # ignore_index: rank 0's shard counts 1 target, rank 1's 4
        dx, dt = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(t, mesh, [Shard(0)])
        self.assertEqual(F.cross_entropy(dx, dt).full_tensor(), F.cross_entropy(x, t))


if __name__ == "__main__":
    run_tests()
