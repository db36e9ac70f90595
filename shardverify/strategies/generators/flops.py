"""How a strategy's compute cost is counted: FLOPs of the local op call as torch's own counter
counts them (:class:`LocalFlopCounter`), and the rule every generator declares and the verifier
checks (:func:`compute_cost`)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

from shardverify.sharding.strategy import TrainCycleItem

__all__ = ["LocalFlopCounter", "compute_cost", "thread_counter"]


def _cpu_flash_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


# Kernels torch's counter does not know: the CPU flash attention that scaled_dot_product_attention
# picks on real CPU tensors (meta tensors take a counted kernel), counted like the GPU flash kernel.
_EXTRA_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_sdpa_flop}


class _CountingMode(_FlopCounterMode):
    """torch's counting mode without the wrapper that disables torch.compile in its dispatch frames:
    the wrapper imports ``torch._dynamo`` at the first op counted (2 CPU-s, more than torch itself,
    for a one-op ``shardverify verify``), and no strategy's local call runs under torch.compile."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    __torch_dispatch__ = getattr(_FlopCounterMode.__dict__["__torch_dispatch__"], "__wrapped__",
                                 _FlopCounterMode.__dict__["__torch_dispatch__"])


class LocalFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` counting exactly as torch does (its registry, its decompositions) but
    without its ``ModuleTracker``, whose process-global module hooks would also fire in the other
    simulated ranks' threads and hang backward hooks on their tensors. Only the global total is
    kept; the dispatch mode itself is thread-local."""

    def __init__(self) -> None:
        super().__init__(display=False, custom_mapping=_EXTRA_FORMULAS)

    def __enter__(self) -> LocalFlopCounter:
        self.flop_counts.clear()
        self.mode = _CountingMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args: object) -> bool | None:
        done = self.mode.__exit__(*args)
        self.mode = None
        return done


_THREAD = threading.local()


def thread_counter() -> LocalFlopCounter:
    """A counter of this thread's, not counting now (its count is cleared as it is entered): made
    once per thread, since making one builds torch's registry of formulas and a module tracker
    again, about a tenth of a small op's counted call (a generator's meta call, a rank's first call
    of a layout). One already counting (a call counted within a counted call) is left to its
    caller, and a new one made."""
    counter = getattr(_THREAD, "counter", None)
    if counter is None:
        counter = _THREAD.counter = LocalFlopCounter()
    return counter if counter.mode is None else LocalFlopCounter()


def compute_cost(flops: float, operand_numels: Iterable[int]) -> TrainCycleItem:
    """The compute-cost rule every generator declares and the verifier checks, per device.

    ``flops``: what ``FlopCounterMode`` counts for the local op call (2 per multiply-accumulate;
    0 when it does not count the op); ``operand_numels``: numels of the local tensors the op is
    called with and returns. Forward = flops / 2 when flops > 0, else the largest numel;
    backward = 2 x forward.
    """
    fwd = float(flops) / 2 if flops else float(max(operand_numels, default=0))
    return TrainCycleItem(fwd, 2 * fwd, 3 * fwd)
