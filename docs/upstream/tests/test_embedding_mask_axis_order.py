"""embedding with the table's rows sharded on mesh axis 0 and the ids on axis 1.

Drop-in test for PyTorch's test/distributed/tensor/test_embedding_ops.py (DTensorTestBase: 4 gloo processes on CPU,
NCCL on GPUs). It fails while the bug is present (docs/upstream/embedding-mask-axis-order.md)."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class DistEmbeddingMaskAxisOrderTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_embedding_rows_on_axis0_ids_on_axis1(self):
        mesh = init_device_mesh(self.device_type, (2, 2))
        ids = torch.randint(0, 8, (4, 6), device=self.device_type)
        table = torch.randn(8, 5, device=self.device_type)
        out = torch.nn.functional.embedding(distribute_tensor(ids, mesh, [Replicate(), Shard(0)]),
                                            distribute_tensor(table, mesh, [Shard(0), Replicate()]))
        self.assertEqual(out.full_tensor(), torch.nn.functional.embedding(ids, table))

if __name__ == "__main__":
    run_tests()
