"""Test data that can tell layouts apart (verify/distinct.py): every two blocks a layout can give
two ranks must differ under one of the seeds a case is checked with, so a wrong layout cannot
pass because the values it mixed up happened to be equal."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from shardverify import DeviceMesh, strategies_for_node
from shardverify.backends import SimulatedBackend
from shardverify.sharding.sharding_spec import ShardingSpec
from shardverify.spec.loader import load_yaml
from shardverify.spec.op import parse_op_spec
from shardverify.verify.distinct import MAX_SEEDS, Seeds, distinguishing_seeds, equal_pairs, splits
from shardverify.verify.engine import _run_check, verify_case

SPECS = Path(__file__).resolve().parents[1] / "specs"


def _case(spec_name: str, target: str):
    spec = parse_op_spec(load_yaml(SPECS / f"{spec_name}.yaml", display=f"specs/{spec_name}.yaml"))
    return next(case for case_id, case in spec.op_cases() if case_id.startswith(target))


def _swapped_order(case, operand_index: int, mesh=(2, 2)):
    """A strategy of ``case`` whose operand at ``operand_index`` is sharded over both axes
    (S01), with that one operand's shard order reversed (S10): the wrong layout."""
    graph_module, name = case.build()
    for strategy in strategies_for_node(graph_module, name, DeviceMesh(mesh)):
        operand, spec = strategy.sharding_specs[operand_index]
        if "S01" in str(spec):
            flipped = ShardingSpec.from_partition(spec.mesh_shape, spec.tensor_shape,
                                                  {d: tuple(reversed(a)) for d, a in spec.partition_dict().items()})
            specs = tuple((n, flipped if n == operand else s) for n, s in strategy.sharding_specs)
            return dataclasses.replace(strategy, name=f"{strategy.name} ({operand} as {flipped})", sharding_specs=specs)
    raise AssertionError(f"no strategy shards operand {operand_index} over both axes")


def test_splits_are_the_block_grids_a_mesh_can_give():
    assert splits((4, 1), (2, 2)) == [((2,), ()), ((2, 2), ())]       # S0 (or S1), S01 (or S10): blocks alike
    assert set(splits((8, 6), (2, 3))) == {((2,), ()), ((3,), ()), ((2, 3), ()), ((3, 2), ()), ((), (2,)),
                                           ((), (3,)), ((2,), (3,)), ((3,), (2,)), ((), (2, 3)), ((), (3, 2))}
    assert splits((3,), (2,)) == [((2,),)]                             # uneven: blocks of 2 and 1


def test_the_two_orders_of_a_dim_over_2_x_3_ranks_give_other_blocks_and_both_are_told_apart():
    """4 rows over (2, 3): S01 gives ranks (a, b) rows 0, 1, -, 2, 3, - and S10 rows 0, 2, -, 1,
    3, -, so rank (0, 1) holds row 1 of an input S01 and row 2 of a mask S10: a mask whose rows 1
    and 2 are equal lets that pass. The (3, 2) cut's blocks are rows 0, 1, 2, 3 in order, so
    that pair is one to separate."""
    mask = torch.tensor([[True], [False], [False], [True]])
    assert equal_pairs(mask, ((2, 3), ())) == {(0, 4), (1, 3)}    # rows 0 and 3, rows 1 and 2; empty blocks never
    assert equal_pairs(mask, ((3, 2), ())) == {(0, 3), (1, 2)}


def test_equal_blocks_are_found_pair_by_pair():
    mask = torch.tensor([[True], [False], [True], [True]])
    assert equal_pairs(mask, (4, 1)) == {(0, 2), (0, 3), (2, 3)}
    assert equal_pairs(mask, (2, 1)) == set()                 # [T, F] against [T, T]
    assert equal_pairs(torch.tensor([float("nan"), float("nan")]), (2,)) == {(0, 1)}


def test_a_bool_mask_of_one_element_blocks_gets_seeds_until_every_pair_differs():
    case = _case("masked_fill", "torch.masked_fill")
    seeds = distinguishing_seeds(case, (2, 2))
    assert 1 < len(seeds.seeds) <= MAX_SEEDS and seeds.seeds[0] == case.seed and not seeds.inseparable
    assert "bool[4, 1] in 2*2x1 blocks" in seeds.note()
    blocks = [[] for _ in range(4)]
    from shardverify.verify.reference import reference

    for seed in seeds.seeds:     # every two of the mask's four one-element blocks differ under some seed
        mask = reference(dataclasses.replace(case, seed=seed), None, torch.device("cpu")).values[("arg", 1)]
        for i in range(4):
            blocks[i].append(bool(mask[i, 0]))
    assert len({tuple(b) for b in blocks}) == 4


def test_a_mask_with_its_shard_order_swapped_is_caught():
    """A swapped shard order: on the spec's own seed the two swapped one-element blocks are equal and
    the wrong strategy passes; the seeds added for the mask make it fail, naming the seed."""
    case = _case("masked_fill", "torch.masked_fill")
    wrong = _swapped_order(case, 1)
    backend = SimulatedBackend(DeviceMesh((2, 2)))
    assert _run_check(backend, case, wrong, None, None, None) == []      # one seed: passes by coincidence
    result = verify_case(backend, case, [wrong])[0]
    assert not result.passed and "S10" in result.strategy
    text = str(result)
    assert "seed=" in text and "output" in text, text


def test_an_embedding_with_its_index_shard_order_swapped_is_caught():
    case = _case("embedding", "torch.nn.functional.embedding")
    wrong = _swapped_order(case, 0)
    result = verify_case(SimulatedBackend(DeviceMesh((2, 2))), case, [wrong])[0]
    assert not result.passed and "grad of weight" in str(result)


def test_blocks_no_seed_can_separate_are_said():
    note = Seeds((0, 1), ("x bool[2] in 2 blocks: 1 equal pair(s), e.g. blocks 0 and 1",),
                 ("x bool[2] in 2 blocks: 1 equal pair(s), e.g. blocks 0 and 1",)).note()
    assert "checked under seeds 0, 1" in note and "a wrong layout swapping them would pass" in note


def test_the_audit_decides_validity_under_every_seed_the_data_needs():
    """The audit finds valid layouts numerically, so equal blocks fool it the same way: with the
    spec's seed alone, the mask in the other shard order than the input looks valid; under the
    seeds that tell the mask's blocks apart it is not."""
    from shardverify.sharding.layout import Layout
    from shardverify.features.audit.combinations import CaseCombinations

    spec = parse_op_spec(load_yaml(SPECS / "masked_fill.yaml", display="specs/masked_fill.yaml"))
    case = next(case for case_id, case in spec.op_cases() if case_id.startswith("torch.masked_fill"))
    audit = CaseCombinations(spec, case, (2, 2), partial_inputs=False)
    assert len(audit.problems) > 1
    swapped = (Layout(((), (0, 1), ())), Layout(((1, 0), ())))    # input [R, S01, R], mask [S10, R]
    assert audit.problem.decide(swapped).valid                     # seed 0's mask: the swapped blocks are equal
    outcome = audit.decide(swapped)
    assert not outcome.valid and "not with seed" in outcome.reason
    assert audit.decide((Layout(((), (0, 1), ())), Layout(((0, 1), ())))).valid


def test_a_tensor_of_distinct_values_is_settled_without_cutting_it_and_a_repeat_is_not():
    """No two blocks of a tensor whose elements all differ can be equal; a tensor repeating a value
    (NaNs count as equal to each other) is still cut split by split, and its equal blocks found."""
    from shardverify.verify.distinct import _all_distinct

    drawn = torch.randn(4, 6, dtype=torch.float64)
    assert _all_distinct(drawn)
    assert all(not equal_pairs(drawn, split) for split in splits((4, 6), (2, 3)))
    nans = torch.tensor([[float("nan"), 1.0], [float("nan"), 2.0]])
    assert not _all_distinct(nans)
    assert equal_pairs(nans[:, :1], (2, 1)) == {(0, 1)}
    assert not _all_distinct(torch.tensor([0.0, -0.0]))   # equal values, whatever their sign bit
    assert not _all_distinct(torch.tensor([1, 2, 1]))
    assert not _all_distinct(torch.tensor([1 + 1j, 2 + 0j]))   # complex: cut split by split
