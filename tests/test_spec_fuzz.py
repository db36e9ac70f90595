"""A bounded fuzz of the spec loader: a real spec of each kind with random values put in random
places (and raw YAML-ish text) either parses or raises a ShardVerifyError subclass, never another
exception (a TypeError from a list where a name was expected was one such traceback)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardverify.features.algorithms.spec import parse_collective_spec
from shardverify.features.ddp.spec import parse_model_spec
from shardverify.errors import ShardVerifyError
from shardverify.spec.loader import load_yaml_text
from shardverify.spec.op import parse_op_spec

ROOT = Path(__file__).resolve().parents[1]
SEEDS = {"op": [ROOT / "specs/sum.yaml", ROOT / "specs/linear.yaml"],
         "collective": sorted((ROOT / "specs/collectives").glob("*.yaml"))[:1],
         "model": [ROOT / "specs/models/mlp.yaml"]}
PARSERS = {"op": parse_op_spec, "collective": parse_collective_spec, "model": parse_model_spec}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**20), st.floats(allow_nan=True),
                    st.sampled_from(["", "x", "dim", "input", "torch.sum", "S0", "[R, S0]", "float32", "1e9"]))
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.lists(st.lists(scalars, max_size=2), max_size=2),
                   st.dictionaries(st.sampled_from(["a", "dim", "kind", "index"]), scalars, max_size=2),
                   st.lists(st.dictionaries(st.sampled_from(["a", "dim"]), scalars, max_size=2), max_size=2))


def _paths(document, prefix=()):
    """Every (container path, key) in a YAML document, leaves and containers alike."""
    found = []
    items = document.items() if isinstance(document, dict) else enumerate(document) if isinstance(document, list) else ()
    for key, child in items:
        found.append((prefix, key))
        found += _paths(child, (*prefix, key))
    return found


def _parse(kind: str, text: str) -> None:
    try:
        PARSERS[kind](load_yaml_text(text, "fuzz.yaml"))
    except ShardVerifyError:
        pass


@pytest.mark.parametrize("kind", sorted(SEEDS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.data())
def test_mutated_specs_raise_only_spec_errors(kind, data):
    seed = data.draw(st.sampled_from(SEEDS[kind]))
    document = copy.deepcopy(yaml.safe_load(seed.read_text()))
    for _ in range(data.draw(st.integers(1, 2))):
        prefix, key = data.draw(st.sampled_from(_paths(document)))
        parent = document
        for step in prefix:
            parent = parent[step]
        parent[key] = data.draw(values)
    _parse(kind, yaml.safe_dump(document))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(text=st.text(alphabet=st.sampled_from(list("ab:- \n[]{},'\"!&*#|>%@`0.9e\t")), max_size=60))
def test_raw_yamlish_text_raises_only_spec_errors(text):
    _parse("op", text)
