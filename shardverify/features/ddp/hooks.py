"""DDP communication hooks by name, including two deliberately wrong ones.

The wrong hooks exist to prove the model check detects reduction bugs: a spec (or a unit test)
runs them with `expect: differ`, and the check must report the parameter and the step.
Every hook has torch's signature `hook(process_group, bucket) -> Future[Tensor]`, registered with
the data-parallel process group as its state. (No `from __future__ import annotations` here: DDP
checks the hooks' annotations against the real `dist.GradBucket` / `Future[Tensor]` objects.)
"""

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

__all__ = ["HOOKS", "COMPRESSION_UNIT_ROUNDOFF", "register_hook",
           "sum_without_average_hook", "skip_first_bucket_hook"]

Hook = Callable[[dist.ProcessGroup, dist.GradBucket], "torch.futures.Future[torch.Tensor]"]


def sum_without_average_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PLANTED BUG: all-reduces the bucket but forgets to divide by the world size."""
    future = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def skip_first_bucket_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PLANTED BUG: bucket 0 is never reduced, so each rank keeps its local gradient for it."""
    if bucket.index() == 0:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future
    return default_hooks.allreduce_hook(group, bucket)


HOOKS: "dict[str, Hook | None]" = {
    "none": None,
    "allreduce": default_hooks.allreduce_hook,
    "fp16_compress": default_hooks.fp16_compress_hook,
    "bf16_compress": default_hooks.bf16_compress_hook,
    "sum_without_average": sum_without_average_hook,
    "skip_first_bucket": skip_first_bucket_hook,
}

# Unit roundoff of the wire format of each compressing hook: 2**-(mantissa bits + 1).
COMPRESSION_UNIT_ROUNDOFF: dict[str, float] = {"fp16_compress": 2.0 ** -11, "bf16_compress": 2.0 ** -8}


def register_hook(ddp: torch.nn.parallel.DistributedDataParallel, name: str,
                  group: dist.ProcessGroup) -> None:
    """Register the hook called `name` on `ddp` (nothing for "none")."""
    hook = HOOKS[name]
    if hook is not None:
        ddp.register_comm_hook(group, hook)
