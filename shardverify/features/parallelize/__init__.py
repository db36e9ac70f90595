"""The parallelism people ship, under test: a model parallelized by a PyTorch parallelize plan
(ParallelStyles, a ``parallelize(model, mesh)`` function with sequence and loss parallel) or by the
tensor-parallel plan a transformers config ships, run against the single-device model from the
same weights and inputs (forward, loss, backward, AdamW steps; training and inference), every
module's output, the loss, every gradient and the weights after the steps compared at the rounding
the single device itself makes, and what differs blamed down to the module and the aten op.

The pipeline of the room: ``models`` (what is built, with its inputs and loss) and ``plans`` (how
it is parallelized) -> ``execute`` (the single device in float64 and in the training dtype, and
every rank of the parallelized model) -> ``compare`` (each value against its rounding budget) ->
``blame`` (the first culprit) -> ``check`` (one verdict) -> ``report``.
"""

from shardverify.features.parallelize.check import ParallelizeResult, check_parallelize

__all__ = ["ParallelizeResult", "check_parallelize"]
