"""Each upstream root cause (docs/upstream/<slug>.md) as a shrinkable example: the call, and the
failing combination ``shardverify dtensor`` found it on (its shapes, mesh and placements), for
:func:`shardverify.features.dtensor.shrink.shrink` to reduce to the minimal example its page shows."""

from __future__ import annotations

from shardverify.features.dtensor.shrink import Example, Family

__all__ = ["ROOT_EXAMPLES"]


def _conv(x, w, b=None):
    import torch

    return torch.nn.functional.conv2d(x, w, b)


def _einsum(a, b):
    import torch

    return torch.einsum("bij,bjk->ik", a, b)


def _embedding(ids, table):
    import torch

    return torch.nn.functional.embedding(ids, table)


def _select_scatter(x, v):
    import torch

    return torch.select_scatter(x, v, 1, -1)


def _flatten_reshape(x):
    import torch

    return torch.flatten(x, 1).reshape(x.numel())


def _cross_entropy_weighted(x, t, w=None):
    import torch

    return torch.nn.functional.cross_entropy(x, t, weight=w)


def _sizes(**named: int) -> tuple[tuple[str, int], ...]:
    return tuple(named.items())


#: slug -> (family, the combination the harness found failing)
ROOT_EXAMPLES: dict[str, tuple[Family, Example]] = {
    "cumsum-negative-dim": (
        Family("cumsum(x, -1)", lambda s: ((s["a"], s["b"], s["c"]),), lambda x: x.cumsum(-1)),
        Example((4,), _sizes(a=8, b=4, c=12), (("S(2)",),))),
    "select-backward-negative-dim": (
        Family("select(x, -1, -1)", lambda s: ((s["a"], s["b"], s["c"]),), lambda x: x.select(-1, -1), backward=True),
        Example((4,), _sizes(a=8, b=4, c=12), (("S(1)",),))),
    "conv2d-runtime-redistribution": (
        Family("conv2d(x, w, b)", lambda s: ((s["n"], s["c"], s["h"], s["h"]), (s["o"], s["c"], s["k"], s["k"]), (s["o"],)),
               _conv),
        Example((4,), _sizes(n=8, c=4, o=16, h=8, k=3), (("R",), ("S(0)",), ("R",)), (True, True, False))),
    # the _StridedShard layout reached by a public route: flatten of a dim sharded on both mesh axes
    "view-strided-shard": (
        Family("flatten(x, 1).view(x.shape)", lambda s: ((s["a"], s["b"], s["c"], s["d"]),),
               lambda x: x.flatten(1).view(x.shape)),
        Example((2, 2), _sizes(a=8, b=4, c=4, d=8), (("S(2)", "S(2)"),))),
    "flatten-backward": (
        Family("flatten(x, 1)", lambda s: ((s["a"], s["b"], s["c"], s["d"]),), lambda x: x.flatten(1), backward=True),
        Example((2, 2), _sizes(a=8, b=4, c=4, d=8), (("S(2)", "S(2)"),))),
    # b in the layout FSDP2 over tensor parallelism on the same dim gives a parameter
    "einsum-strided-shard": (
        Family('einsum("bij,bjk->ik")', lambda s: ((s["b"], s["i"], s["j"]), (s["b"], s["j"], s["k"])), _einsum),
        Example((2, 2), _sizes(b=4, i=8, j=8, k=8), (("S(0)", "R"), ("_S(1, sf=2)", "S(1)")))),
    "embedding-mask-axis-order": (
        Family("embedding(ids, table)", lambda s: ((s["n"], s["l"]), (s["v"], s["d"])), _embedding,
               integer=(0,), high="v"),
        Example((2, 2), _sizes(n=8, l=8, v=8, d=16), (("R", "S(0)"), ("S(0)", "R")))),
    "scatter-backward-plain-zeros": (
        Family("select_scatter(x, v, 1, -1)", lambda s: ((s["a"], s["b"], s["c"]), (s["a"], s["c"])), _select_scatter,
               backward=True),
        Example((4,), _sizes(a=8, b=4, c=6), (("S(0)",), ("S(0)",)))),
    "nll-loss-weighted-mean": (
        Family("cross_entropy(x, t, weight=w)", lambda s: ((s["n"], s["c"]), (s["n"],), (s["c"],)),
               _cross_entropy_weighted, integer=(1,), high="c"),
        Example((4,), _sizes(n=8, c=8), (("S(0)",), ("S(0)",), ("R",)), (True, True, True))),
    "reshape-strided-shard-error-message": (
        Family("flatten(x, 1).reshape(numel)", lambda s: ((s["a"], s["b"], s["c"], s["d"]),), _flatten_reshape,
               message="1"),
        Example((2, 2), _sizes(a=8, b=4, c=4, d=8), (("S(2)", "S(2)"),))),
}
