"""Refusals in a user's words: every reason an OpInfo sample's call is refused names the spec
and says what does not fit in terms of the call (its dims, sizes and arguments), never in the
engine's (internal factor names, meta tensors, graph values, the rules engine's terms)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardverify.features.opinfo.samples import entries_for
from shardverify.features.opinfo.sweep import sweep_entry
from shardverify.spec.catalogue import load_op_specs
from shardverify.spec.names import resolve_dotted
from shardverify.verify.on_demand import OnDemandVerifier

pytestmark = pytest.mark.slow   # refusals collected over the shipped specs

REPO = Path(__file__).resolve().parents[1]

#: what only the engine says: factors it names itself, how it sizes layouts up, its data types
ENGINE_WORDS = re.compile(r"\b_b\d|meta tensor|graph value|\(aligned\)|this rank|factor '|term\(s\)|"
                          r"OperationData|Proxy|not a traced tensor|local shapes")

#: specs whose OpInfo samples include calls their rule does not describe (a 0-d input, a dim the
#: rule is not written for, an argument computed in the graph, a number where a tensor goes)
SPECS = ("index_add", "index_select", "repeat_interleave", "scatter_reduce", "cross_entropy",
         "native_batch_norm_legit_train", "to_dtype", "as_strided", "specs/scatter.yaml")


@pytest.fixture(scope="module")
def refusals():
    found = []
    with OnDemandVerifier(cache_dir=None) as verifier:
        for spec in load_op_specs(REPO, None, list(SPECS)):
            targets = [resolve_dotted(t.name) for t in spec.targets]
            for entry in entries_for(targets):
                result = sweep_entry(entry, spec.name, targets, meshes=((2, 2),), limit=12, verifier=verifier,
                                     check_grid=False)
                found += [o for o in result.outcomes if o.outcome == "refused"]
    return found


def test_refusals_speak_of_the_call_and_the_spec(refusals):
    assert refusals, "no sample of these specs is refused: pick specs whose samples are"
    engine = sorted({o.reason for o in refusals if ENGINE_WORDS.search(o.reason)})
    assert not engine, engine[:5]
    unnamed = sorted({o.reason for o in refusals if "specs/" not in o.reason})
    assert not unnamed, unnamed[:5]
