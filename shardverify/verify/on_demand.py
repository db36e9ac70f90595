"""Verification on demand: a call its spec's grid never covered is verified where it is met.

A spec's grid verifies its rule at a few parameter values and shapes; real calls pass others
(``groups=16``, ``alpha=2``, a ``dtype``, a 1-d id tensor). Refusing them kept every served
strategy sound but served little. :class:`OnDemandVerifier` keeps the guarantee without the
refusal: handed an :class:`~shardverify.strategies.for_node.UnverifiedCall` (the rule's strategies
at that call), it verifies every one of them at that very call (its shapes, dtypes and argument
values, the usual distinguishing data, forward and backward, on the call's mesh, simulated) and
serves those that pass. Those that fail are a rule defect: never offered, and recorded with the
spec, the call and the strategies, for plan reports and ``verify``. Verdicts are kept on disk by
(the rule, the call's signature, the mesh, torch's version, a digest of shardverify's own
generator and engine code), so a model's second run verifies nothing again; the verifier counts
calls verified, cache hits and the seconds spent.

A cached verdict decides which strategies are served, and its folder is anyone's to edit, so a
record is evidence to check, not a verdict to believe (:func:`record_problem`): read through
:mod:`shardverify.stored` (a regular file, bounded), it must name its own key and exactly the
strategies the rule yields at the call, every failed strategy among them, and carry the checksum
of its content; a record that does not is discarded and the call verified again (counted, and
said in the report). Nothing is re-verified on a sample: one call's verification costs more than
the whole of a warm plan's cache reads.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx

from shardverify.capture.meta import tensor_meta
from shardverify.backends.simulated import SimulatedBackend
from shardverify.capture.call import target_name
from shardverify.errors import HandlerError, InvalidArgument, ShardVerifyError
from shardverify.sharding.mesh import DeviceMesh
from shardverify.sharding.strategy import ShardingStrategy
from shardverify.stored import StoreError, items, need, read_json, write_json
from shardverify.strategies.for_node import UnverifiedCall, find_node, handler_strategies
from shardverify.strategies.handlers.base import HandlerDef
from shardverify.strategies.handlers.serving import handler_for_node
from shardverify.verify.call_case import CallCase, call_case, describe_call
from shardverify.verify.engine import verify_case
from shardverify.verify.isolated import isolates, run_isolated
from shardverify.verify.reference import reference
from shardverify.verify.report import CheckResult

__all__ = ["CACHE_ENV", "OnDemandRecord", "OnDemandVerifier", "verify_node", "every_strategy", "default_cache_dir",
           "checkable_case", "code_digest", "record_problem", "no_cache_reason", "rule_text"]

CACHE_ENV = "SHARDVERIFY_CACHE_DIR"
#: bumped whenever what a verdict means changes: older verdicts on disk are then never read
VERDICT_FORMAT = 4   # 2: ids below 1 tried last (a 0-d tensor's one element), refusals of format 1 drew none;
                     # 3: the low-precision budget at the ranks' shapes (long reductions refused for rounding pass);
                     # 4: a call that draws random numbers runs on one fixed generator state (refused before)


#: the packages whose code decides a verdict: the strategy generators and the verification engine
#: with what it runs on (layouts, simulated collectives and backends, the one way an op is called)
CODE_PACKAGES = ("strategies", "verify", "sharding", "collectives", "backends", "capture")
#: the most bytes of one cached verdict (a few strategies' names and first mismatches)
MAX_VERDICT_BYTES = 1 << 20


def no_cache_reason() -> str:
    """Why there is no default verdict cache ("" when there is one): neither ``$SHARDVERIFY_CACHE_DIR``
    nor an absolute ``$HOME`` is set (a cache under ``/.cache`` would be everyone's)."""
    if os.environ.get(CACHE_ENV):
        return ""
    home = os.environ.get("HOME", "")
    return "" if os.path.isabs(home) and home != "/" else \
        f"no verdict cache: $HOME is {'not set' if not home else repr(home)}; set ${CACHE_ENV} to keep verdicts"


def default_cache_dir() -> Path | None:
    """``$SHARDVERIFY_CACHE_DIR``, else ``$HOME/.cache/shardverify/verdicts``; None (no disk cache,
    :func:`no_cache_reason` says why) without either."""
    found = os.environ.get(CACHE_ENV)
    if found:
        return Path(found)
    return None if no_cache_reason() else Path(os.environ["HOME"]) / ".cache" / "shardverify" / "verdicts"


@functools.cache
def code_digest() -> str:
    """The sha256 of the source of :data:`CODE_PACKAGES` (each file's path and bytes, in order):
    part of every verdict's key, so a verdict made by other generator or engine code is never
    read. Once per process, as the code a process runs is the code it loaded."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@dataclass(frozen=True)
class OnDemandRecord:
    """What happened to one call outside its grid."""

    spec_file: str
    node: str
    call: str                       # the call as captured, tensors by dtype and shape
    reason: str                     # why the grid did not cover it
    mesh_shape: tuple[int, ...]
    offered: int                    # strategies the rule yields at the call
    failed: tuple[tuple[str, str], ...] = ()   # (strategy, first mismatch) of each that failed
    cached: bool = False
    seconds: float = 0.0            # verifying it, or (cached) finding its verdict
    refused: str = ""               # why the call could not be checked at all

    @property
    def passed(self) -> int:
        return 0 if self.refused else self.offered - len(self.failed)

    def defect(self) -> str:
        """The rule defect, as a spec author reads it: ``specs/triu.yaml: 4 strategies wrong at
        aten.triu.default(float64[4, 6], 0) on mesh (2, 2), not offered: '[S0, R] -> ...', ..."""
        names = ", ".join(repr(name) for name, _ in self.failed[:4]) + (", ..." if len(self.failed) > 4 else "")
        return (f"{self.spec_file}: {len(self.failed)} of {self.offered} strateg{'y' if self.offered == 1 else 'ies'} "
                f"wrong at {self.call} on mesh {self.mesh_shape}, not offered: {names}")


def every_strategy(call: UnverifiedCall) -> Sequence[ShardingStrategy]:
    """The rule's strategies at a call, unverified: for callers that verify every one themselves
    (:func:`verify_node`, the explorer)."""
    return call.strategies


every_strategy.cache_key = "unverified"   # type: ignore[attr-defined]


def _drawn(handler: HandlerDef, operands: Mapping) -> dict[str, tuple[tuple[float, float] | None, bool]]:
    """Placeholder name -> (values, grad) from the spec's declared data of the operand it is."""
    declared = {role: (values, grad) for role, values, grad in handler.drawn}
    found = {}
    for role, data in operands.items():
        if role in declared:
            found.setdefault(str(data.name).split("@")[0], declared[role])
    return found


def _candidate_highs(case: CallCase, name: str, low: float, high: float) -> list[int]:
    """Upper bounds to try for integer input ``name``, largest first: the declared one and every
    dim size of the call's other tensors (ids below a table's rows, an index below its dim), and
    last 1: ids all 0, which every dim of at least one element takes (a 0-d tensor's one element,
    where no other tensor has a dim to bound the ids by)."""
    sizes = {int(s) for i in case.inputs if i.name != name for s in i.shape} | {1}
    return sorted({int(high)} | {s for s in sizes if s > low}, reverse=True)


def _partitions(case: CallCase, decl) -> list:
    """``decl`` as counts that cut a dim of another input into consecutive pieces, row by row along
    its last dim (``segment_reduce``'s lengths: they add up to the dim), and as the pieces' bounds
    (its offsets: 0 first, the dim's size last, nondecreasing); one of each per dim size of the
    call's other tensors, largest first. Drawn with a fixed seed: the same call, the same data."""
    if not decl.shape or decl.shape[-1] < 1:
        return []
    generator = torch.Generator().manual_seed(zlib.crc32(decl.name.encode()))
    rows, k = math.prod(decl.shape[:-1]), decl.shape[-1]
    found = []
    for size in sorted({int(s) for i in case.inputs if i.name != decl.name for s in i.shape}, reverse=True):
        cuts = torch.randint(0, size + 1, (rows, k - 1), generator=generator).sort(dim=-1).values
        bounds = torch.cat([torch.zeros(rows, 1, dtype=torch.int64), cuts,
                            torch.full((rows, 1), size, dtype=torch.int64)], dim=-1)
        lengths = bounds.diff(dim=-1)                        # k pieces adding up to size
        # k bounds from 0 to size, nondecreasing
        offsets = bounds[:, torch.linspace(0, k, k).round().long()] if k > 1 else bounds[:, :1]
        found += [dataclasses.replace(decl, values=None, data=tuple(float(v) for v in t.flatten().tolist()))
                  for t in (lengths, offsets)]
    return found


def _square(decl) -> bool:
    """A floating input of square matrices ([..., n, n])."""
    return decl.torch_dtype.is_floating_point and len(decl.shape) >= 2 and decl.shape[-1] == decl.shape[-2] > 0


def _positive_definite(decl):
    """``decl`` as symmetric positive definite matrices, each its own (``a @ a.mT + n``), drawn
    with a fixed seed: the same call, the same data."""
    generator = torch.Generator().manual_seed(zlib.crc32(decl.name.encode()))
    a = torch.randn(decl.shape, generator=generator, dtype=torch.float64)
    n = decl.shape[-1]
    matrices = a @ a.mT + n * torch.eye(n, dtype=torch.float64)
    return dataclasses.replace(decl, values=None, data=tuple(matrices.flatten().tolist()))


def _with_working_data(case: CallCase) -> CallCase:
    """The case with integer inputs drawn in the widest range the op accepts at this call: the
    spec declares ids below its own grid's table; a call's table has its own rows; a divisor takes
    no zero; last, counts and bounds that cut another input's dim into pieces (see
    :func:`_partitions`), and square matrices made positive definite. The reference is built on
    the way (HandlerError when the op cannot run on any such data, or is random: nothing could be
    checked)."""
    last: Exception | None = None
    random: ShardVerifyError | None = None
    integer = [i for i in case.inputs if not i.torch_dtype.is_floating_point and i.torch_dtype != torch.bool
               and not i.torch_dtype.is_complex]
    tries = [case]
    for decl in integer:
        low, high = decl.values if decl.values is not None else (0, 8)
        ranges = [(low, h) for h in _candidate_highs(case, decl.name, low, high)]
        ranges += [(1, h) for _, h in ranges if low < 1 < h]   # no zero: a divisor, a remainder's modulus
        tries = [dataclasses.replace(t, inputs=tuple(dataclasses.replace(i, values=r) if i.name == decl.name
                                                     else i for i in t.inputs))
                 for t in tries for r in ranges] or tries
    tries = tries[:16] + [dataclasses.replace(case, inputs=tuple(one if i.name == decl.name else i
                                                                 for i in case.inputs))
                          for decl in integer for one in _partitions(case, decl)]
    if any(_square(i) for i in case.inputs):   # square matrices made symmetric positive definite (cholesky's)
        tries.append(dataclasses.replace(case, inputs=tuple(_positive_definite(i) if _square(i) else i
                                                            for i in case.inputs)))
    for attempt in tries:
        for data in (attempt, _forward_only(attempt)):
            try:
                reference(data, None, torch.device("cpu"))
                return data
            except ShardVerifyError as error:     # the op is random: no layout can be checked against it
                if not integer:                   # else perhaps ids out of range read memory: try the next
                    raise HandlerError(f"cannot be verified at this call: {str(error).splitlines()[0]}") from None
                random, last = error, error
                break
            except Exception as error:  # noqa: BLE001 - the op refuses these data; try the next range
                last = error
                if not _no_derivative(error):
                    break
    if random is not None and last is random:
        raise HandlerError(f"cannot be verified at this call: {str(random).splitlines()[0]}")
    raise HandlerError(f"cannot be verified at this call: the op raised on every drawn input "
                       f"({type(last).__name__}: {str(last).splitlines()[0] if str(last) else ''})")


def _no_derivative(error: Exception) -> bool:
    """Does torch say the op has no backward (``floor_divide`` of floats)? Then no plan can take
    a gradient through the call, and its forward is all there is to verify."""
    text = str(error)
    return "derivative for" in text and "not implemented" in text


def _forward_only(case: CallCase) -> CallCase:
    return dataclasses.replace(case, inputs=tuple(dataclasses.replace(i, grad=False) for i in case.inputs))


def checkable_case(handler: HandlerDef, graph_module: fx.GraphModule, node: fx.Node, operands: Mapping) -> CallCase:
    """The captured call as a case, with data the op accepts there (see :func:`_with_working_data`);
    searched in a child where the op's kernel can corrupt memory on data it does not take (its
    spec's ``verify.isolate``, or it crashed before)."""
    case = call_case(handler.name, graph_module, node, _drawn(handler, operands), isolate=handler.isolate)
    if not isolates(case):
        return _with_working_data(case)
    try:
        return run_isolated(_with_working_data, case)
    except HandlerError:
        raise
    except ShardVerifyError as error:
        raise HandlerError(f"cannot be verified at this call: {error} while drawing data the op takes") from None


def _module_text(node: fx.Node, graph_module: fx.GraphModule) -> str:
    """A module call's configuration as its repr shows it (Conv2d's stride, groups): part of the call."""
    return repr(graph_module.get_submodule(str(node.target))) if node.op == "call_module" else ""


def _signature(value: object) -> object:
    """A call's argument as stable text: a tensor by shape and dtype, a number by its repr."""
    if isinstance(value, fx.Node):
        meta = tensor_meta(value)
        return ["tensor", list(meta.shape), str(meta.dtype)] if meta is not None else ["node", value.name]
    if isinstance(value, (list, tuple)):
        return [_signature(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _signature(v) for k, v in value.items()}
    return repr(value)


def rule_text(handler: HandlerDef) -> str:
    """What the strategies depend on, stably: the spec's text where it can be read, and the
    handler's declarations (the parsed rule, the operands and parameters, the data drawn and its
    dtypes)."""
    spec_text = ""
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        path = base / handler.spec_file
        if handler.spec_file and path.is_file():
            spec_text = path.read_text(encoding="utf-8", errors="replace")
            break
    return json.dumps([handler.name, handler.generator, repr(handler.rule), repr(handler.operands),
                       repr(handler.params), repr(handler.drawn), repr(handler.dtypes), repr(handler.ignores),
                       spec_text])


def verdict_key(call: UnverifiedCall) -> str:
    """The disk cache's key of a call's verdict: rule, call signature, mesh, strategies, torch,
    shardverify's generator and engine code (:func:`code_digest`)."""
    node = call.node
    text = json.dumps([VERDICT_FORMAT, torch.__version__, code_digest(), rule_text(call.handler),
                       target_name(node), _module_text(node, call.graph_module), _signature(list(node.args)),
                       _signature(dict(node.kwargs)), _signature(node), list(call.mesh.shape),
                       sorted(s.name for s in call.strategies)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class OnDemandVerifier:
    """Serves the strategies of calls outside their grid that verify where they are met (an
    :class:`~shardverify.strategies.for_node.OnDemand`). One simulated backend per mesh, made
    when first needed; :meth:`close` ends them."""

    cache_dir: Path | None = field(default_factory=default_cache_dir)   # None: no disk cache
    timeout: float | None = None
    records: list[OnDemandRecord] = field(default_factory=list)
    discarded: list[str] = field(default_factory=list)   # why each cached record found was not believed
    _backends: dict = field(default_factory=dict, repr=False)

    @property
    def cache_key(self) -> object:
        return ("on-demand", id(self))

    def __call__(self, call: UnverifiedCall) -> Sequence[ShardingStrategy]:
        start = time.perf_counter()
        key = verdict_key(call)
        names = sorted(s.name for s in call.strategies)
        found = self._load(key, names)
        label = describe_call(call.graph_module, call.node)
        common = dict(spec_file=call.handler.spec_file or call.handler.name, node=call.node.name, call=label,
                      reason=call.reason, mesh_shape=tuple(call.mesh.shape), offered=len(call.strategies))
        if found is not None:
            record = OnDemandRecord(**common, failed=tuple(map(tuple, found["failed"])), cached=True,
                                    refused=found["refused"], seconds=time.perf_counter() - start)
        else:
            try:
                failed, refused = self._verify(call), ""
            except HandlerError as error:
                failed, refused = (), str(error)
            record = OnDemandRecord(**common, failed=failed, seconds=time.perf_counter() - start, refused=refused)
            self._store(key, _sealed({"key": key, "offered": names, "failed": [list(f) for f in failed],
                                      "refused": refused, "call": label}))
        self.records.append(record)
        if record.refused:
            raise HandlerError(f"{call.reason}; {record.refused}")
        wrong = {name for name, _ in record.failed}
        kept = [s for s in call.strategies if s.name not in wrong]
        if not kept:
            raise HandlerError(f"{call.reason}; verified at the call, every strategy failed: {record.defect()}")
        return kept

    def _verify(self, call: UnverifiedCall) -> tuple[tuple[str, str], ...]:
        case = checkable_case(call.handler, call.graph_module, call.node, call.operands)
        results = verify_case(self.backend(call.mesh), case, call.strategies, timeout=self.timeout)
        return tuple((r.strategy, _first_problem(r)) for r in results if not r.passed)

    def backend(self, mesh: DeviceMesh) -> SimulatedBackend:
        """This verifier's simulated backend on ``mesh`` (made once)."""
        shape = tuple(mesh.shape)
        if shape not in self._backends:
            self._backends[shape] = SimulatedBackend(DeviceMesh(shape))
        return self._backends[shape]

    def close(self) -> None:
        for backend in self._backends.values():
            backend.close()
        self._backends.clear()

    def __enter__(self) -> OnDemandVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the verdicts on disk -----------------------------------------------------
    def _path(self, key: str) -> Path | None:
        return None if self.cache_dir is None else Path(self.cache_dir) / key[:2] / f"{key}.json"

    def _load(self, key: str, offered: list[str]) -> dict | None:
        """The cached verdict of ``key`` when there is one and it checks (:func:`record_problem`);
        one that does not is discarded (said in :meth:`lines`) and the call verified again."""
        path = self._path(key)
        if path is None:
            return None
        try:
            found = read_json(path, MAX_VERDICT_BYTES)
        except StoreError as error:
            self.discarded.append(str(error))
            return None
        problem = None if found is None else record_problem(found, key, offered, str(path))
        if problem:
            self.discarded.append(problem)
            return None
        return found

    def _store(self, key: str, verdict: dict) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            write_json(path, verdict)   # whole or not at all: another process reads the whole verdict or none
        except OSError:
            pass                  # a read-only cache only costs the next run a verification

    # ---- what a report says -------------------------------------------------------
    def summary(self) -> dict:
        fresh = [r for r in self.records if not r.cached]
        return {"calls": len(self.records), "verified": len(fresh), "cache_hits": len(self.records) - len(fresh),
                "seconds": round(sum(r.seconds for r in fresh), 3),
                "cache_seconds": round(sum(r.seconds for r in self.records if r.cached), 3),
                "strategies_verified": sum(r.offered for r in fresh if not r.refused),
                "strategies_wrong": sum(len(r.failed) for r in self.records),
                "refused": sum(1 for r in self.records if r.refused),
                "discarded": len(self.discarded),
                "defects": [r.defect() for r in self.records if r.failed]}

    def lines(self) -> list[str]:
        if not self.records:
            return []
        s = self.summary()
        lines = [f"verified on demand: {s['calls']} call(s) outside their spec's grid, {s['verified']} verified now "
                 f"({s['strategies_verified']} strategies, {s['seconds']:.1f} s), {s['cache_hits']} from the verdict "
                 f"cache; {s['strategies_wrong']} wrong strateg{'y' if s['strategies_wrong'] == 1 else 'ies'} not "
                 f"offered, {s['refused']} call(s) refused"]
        lines += [f"  rule defect: {text}" for text in s["defects"]]
        if self.discarded:
            lines.append(f"  {len(self.discarded)} cached verdict(s) did not check, discarded and verified again "
                         f"(first: {self.discarded[0][:200]})")
        if self.cache_dir is None and no_cache_reason():
            lines.append(f"  {no_cache_reason()}")
        return lines


def _checksum(record: dict) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in record.items() if k != "sum"}, sort_keys=True).encode()
                          ).hexdigest()


def _sealed(record: dict) -> dict:
    """``record`` with the checksum of its content (:func:`record_problem` checks it)."""
    return {**record, "sum": _checksum(record)}


def record_problem(record: object, key: str, offered: list[str], file: str) -> str:
    """Why a cached verdict read from ``file`` is not believed ("" when it checks): a field of the
    wrong kind, another call's key, other strategies than the rule's ``offered`` names, a failed
    strategy it did not offer, or content that is not what its checksum was made of."""
    try:
        need(record, "key", str, file=file)
        sum_ = need(record, "sum", str, file=file)
        names = items(need(record, "offered", list, file=file), str, file=file, field="offered")
        failed = items(need(record, "failed", list, file=file), list, file=file, field="failed")
        for index, pair in enumerate(failed):
            items(pair, str, file=file, field=f"failed[{index}]")
        need(record, "refused", str, file=file)
        need(record, "call", str, file=file)
    except StoreError as error:
        return str(error)
    if record["key"] != key:
        return f"{file}: field 'key': the verdict of another call"
    if names != offered:
        return f"{file}: field 'offered': other strategies than the rule yields at the call"
    if any(len(pair) != 2 or pair[0] not in offered for pair in failed):
        return f"{file}: field 'failed': not (strategy offered, first mismatch) pairs"
    if sum_ != _checksum(record):
        return f"{file}: field 'sum': the content is not what was stored"
    return ""


def _first_problem(result: CheckResult) -> str:
    if not result.mismatches:
        return ""
    m = result.mismatches[0]
    return (f"rank {m.rank} {m.tensor}: {m.kind}" + (f", max abs error {m.max_abs_err:.3g}"
                                                      if getattr(m, "max_abs_err", None) else "")
            + (f" ({m.detail.splitlines()[0]})" if m.detail else ""))[:300]


def verify_node(graph_module: fx.GraphModule, node: str | int | fx.Node, mesh, *, backend=None,
                timeout: float | None = None) -> list[CheckResult]:
    """Verify every strategy of one captured call, whatever its spec's grid covered: the call
    cut out as it was captured (zero-size shapes, tensor keywords, ``None`` in a tensor list
    included), on ``backend`` (default: simulated on ``mesh``). HandlerError when no handler
    serves the call or it cannot be checked (a random op, data it always refuses)."""
    if not isinstance(graph_module, fx.GraphModule):
        raise InvalidArgument(f"graph_module must be a torch.fx.GraphModule, got {type(graph_module).__name__}")
    mesh = mesh if isinstance(mesh, DeviceMesh) else DeviceMesh(tuple(mesh))
    node = node if isinstance(node, fx.Node) else find_node(graph_module, node)
    handler = handler_for_node(node, graph_module)
    if handler is None:
        raise HandlerError(f"no handler for node {node.name!r} ({describe_call(graph_module, node)}); "
                           f"write a spec for it in specs/")
    operands, strategies = handler_strategies(handler, graph_module, node, mesh, every_strategy)
    case = checkable_case(handler, graph_module, node, operands)
    if backend is not None:
        return verify_case(backend, case, strategies, timeout=timeout)
    with SimulatedBackend(mesh) as own:
        return verify_case(own, case, strategies, timeout=timeout)
