"""A stated sample of a case's layout combinations, for a case over the combination limit.

Some cases have millions of combinations on a 3-axis mesh (baddbmm, conv2d with a bias,
batch_norm on (2, 2, 2)): holding an outcome for each is gigabytes and deciding them all takes
hours. Such a case is decided on a uniform sample of its combinations, drawn with a fixed seed
(the same sample every run, so a finding can be reproduced), and says so: a missing
combination is searched for only in the sample, while every offered strategy is still decided
on its own. A combination with an absent (post-added) operand is only needed when no
combination passing that operand in as a full value gives the same output, so a valid sampled
one is looked up among its counterparts (decided until one gives the same output): without
them, the sample would report it missing.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence

from shardverify.sharding.layout import Layout
from shardverify.spec.limits import Limit

__all__ = ["AUDIT_SAMPLE", "SAMPLE_SEED", "counterparts", "sampled_indices"]

#: combinations drawn from a case over MAX_AUDIT_COMBINATIONS (before the counterparts of absent operands)
AUDIT_SAMPLE = Limit("layout combinations sampled from a case over the combination limit", 4_000,
                     "SHARDVERIFY_AUDIT_SAMPLE")
SAMPLE_SEED = 0


def sampled_indices(lengths: Sequence[int], size: int, seed: int = SAMPLE_SEED) -> Iterator[tuple[int, ...]]:
    """``size`` distinct combinations drawn uniformly from the product of operands with
    ``lengths`` layouts each, in index order, each as its layouts' indices (the last operand
    varying fastest)."""
    total = math.prod(lengths)
    rng = random.Random(seed)
    picked: set[int] = set()
    while len(picked) < min(size, total):
        picked.add(rng.randrange(total))
    for index in sorted(picked):
        combo = []
        for length in reversed(lengths):
            index, at = divmod(index, length)
            combo.append(at)
        yield tuple(reversed(combo))


def counterparts(choices: Sequence[Sequence[Layout]], combo: tuple[Layout, ...]) -> Iterator[tuple[Layout, ...]]:
    """``combo`` with each of its absent operands passed in as a full value instead: every
    non-partial layout of theirs in their place (the combinations that make an absent one
    unneeded when one of them gives the same output)."""
    absent = [i for i, layout in enumerate(combo) if layout.absent]
    full = [[layout for layout in choices[i] if not layout.absent and not layout.partial] for i in absent]
    for replacement in itertools.product(*full) if absent else ():
        candidate = list(combo)
        for i, layout in zip(absent, replacement):
            candidate[i] = layout
        yield tuple(candidate)
