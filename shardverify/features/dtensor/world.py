"""The in-process worlds DTensor runs in here: a fake process group of the mesh's size (no
network), and on it either DTensor's sharding propagation alone or, under DTensor's own
``LocalTensorMode``, its execution on every rank at once (each tensor holds every rank's local
value; collectives combine them). Both are torn down afterwards, so the process is left as it
was, and one world exists at a time (a lock: the process group is global)."""

from __future__ import annotations

import contextlib
import math
import threading

__all__ = ["fake_world", "local_world"]

_LOCK = threading.Lock()


@contextlib.contextmanager
def _fake_process_group(world_size: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with _LOCK:
        if dist.is_initialized():
            raise RuntimeError("a process group is already initialised in this process; running DTensor "
                               "in process needs its own fake one")
        dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def fake_world(mesh_shape: tuple[int, ...]):
    """A DeviceMesh on a fake process group: DTensor propagates placements, collectives are
    hallucinated (rank 0's values only)."""
    from torch.distributed.device_mesh import init_device_mesh

    with _fake_process_group(math.prod(mesh_shape)):
        yield init_device_mesh("cpu", tuple(mesh_shape))


@contextlib.contextmanager
def local_world(mesh_shape: tuple[int, ...]):
    """``(mesh, mode)``: a DeviceMesh made under DTensor's ``LocalTensorMode`` of every rank;
    enter ``mode`` around the code that runs DTensor (outside it, plain tensors stay plain)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    world = math.prod(mesh_shape)
    with _fake_process_group(world):
        mode = LocalTensorMode(world)
        with mode:
            mesh = init_device_mesh("cpu", tuple(mesh_shape))
        yield mesh, mode
