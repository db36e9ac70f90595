"""flatten then reshape of a tensor sharded inside the flattened dims: it must either work or\nraise an error that says why (not a RuntimeError whose message is '1').

Drop-in test for PyTorch's test/distributed/tensor/test_view_ops.py (DTensorTestBase: 2 gloo processes on CPU,
NCCL on GPUs). It fails while the bug is present (docs/upstream/reshape-strided-shard-error-message.md)."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class DistReshapeStridedShardErrorTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 2

    @with_comms
    def test_flatten_then_reshape_to_1d(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        x = torch.randn(2, 2, 4, 3, device=self.device_type)
        flat = torch.flatten(distribute_tensor(x, mesh, [Shard(2)]), 1)
        try:
            out = flat.reshape(x.numel())
        except RuntimeError as exc:
            self.assertNotEqual(str(exc).splitlines()[0].strip(), "1", msg=f"an error that says nothing: {exc!r}")
        else:
            self.assertEqual(out.full_tensor(), x.reshape(-1))

if __name__ == "__main__":
    run_tests()
