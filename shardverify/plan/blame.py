"""Whose gradient is wrong: a gradient mismatch blamed on the node that owes the reduction.

A node's output gradient is the sum of what each of its users passes back. When the gradient
first diverges at node P (the last node in graph order whose output gradient differs, the first
backward reaches) while every user's own output gradient agrees, the wrong term came from one
user's backward: its declared collective (a column-parallel linear's all-reduce of its input's
gradient) or the resharding before it. The check taps each edge from a node with several users
(the value a user takes, as a view of its own, its gradient kept) on the single device and on
every rank, so the user whose term diverges is found; a node with one user blames that user.
"""

from __future__ import annotations

from torch import fx

from shardverify.sharding.strategy import CommPattern, CommWhere
from shardverify.plan.compare import compare_value, expected_shard
from shardverify.verify.report import Mismatch
from shardverify.plan.graph import operand_producer

__all__ = ["tapped_edges", "owed_collectives", "blame_owner"]

_BACKWARD = {
    CommPattern.IDENTITY_FWD_ALLREDUCE_BWD: "an all-reduce of its gradient",
    CommPattern.ALLREDUCE_FWD_IDENTITY_BWD: "no backward collective (all-reduce forward only)",
    CommPattern.GATHER_FWD_SPLIT_BWD: "a split of its gradient",
    CommPattern.SPLIT_FWD_GATHER_BWD: "an all-gather of its gradient",
    CommPattern.ALL2ALL_FWD_ALL2ALL_BWD: "an all-to-all of its gradient",
}


def tapped_edges(gm: fx.GraphModule, skipped: frozenset[str]) -> frozenset[tuple[str, str]]:
    """(user, producer) of every edge out of a compared op node with two or more users."""
    found = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or node.name in skipped:
            continue
        users = [u for u in node.users if u.op != "output"]
        if len(users) > 1:
            found.update((u.name, node.name) for u in users)
    return frozenset(found)


def owed_collectives(node: fx.Node, strategy, producer: str) -> str:
    """The collectives ``node``'s strategy declares on the gradient of its operand from ``producer``."""
    if strategy is None:
        return "it runs replicated (no strategy): the resharding before it carries the gradient back"
    operands = [d.name for d in strategy.inputs if d.locator.kind not in ("param", "buffer")
                and getattr(operand_producer(node, d.locator), "name", None) == producer]
    actions = [a for a in strategy.communication_actions if a.operand in operands and a.where is CommWhere.BEFORE]
    if not actions:
        return f"its strategy declares no collective on the gradient of operand {', '.join(operands) or '?'}"
    return "; ".join(f"operand {a.operand}: {_BACKWARD[a.pattern]} over mesh axes {list(a.axes)}" for a in actions)


def blame_owner(found: list, gm: fx.GraphModule, plan: Plan, taps: dict, layouts: dict, ref_grads: dict, comm,
           tolerance) -> None:
    """An "owner" mismatch for the user that passes a wrong gradient back to the node backward
    first finds wrong (see :mod:`shardverify.plan.blame`)."""
    wrong = [m for m in found if m.phase == "backward"]
    if not wrong:
        return
    first = max(wrong, key=lambda m: m.order)
    order = {item.node: i for i, item in enumerate(plan.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    users = sorted((u for u in by_name[first.node].users if u.op != "output"), key=lambda u: -order[u.name])
    for user in users:
        if len(users) == 1:
            error = first.max_abs_err
        else:
            tap = taps.get((user.name, first.node))
            expected = ref_grads.get((user.name, first.node))
            if tap is None or expected is None:
                continue
            term: list = []
            share = expected_shard(layouts[first.node], expected, comm.mesh, comm.rank)
            compare_value(term, "owner", 0, "", "", comm.rank, tap.grad, share, tolerance)
            if not term:
                continue
            error = term[0].max_abs_err
        owes = owed_collectives(user, plan.node(user.name).strategy, first.node)
        found.append(Mismatch("values", comm.rank, f"gradient passed back to {first.node!r} ({owes})",
                              max_abs_err=error, phase="owner", node=user.name, order=order[user.name]))
