"""How fast is one strategy check, and how does it compare with its baselines in this run?

For each op (linear, sum: the first cases of their specs) and mesh ((2,2), (2,2,2)) it measures
the milliseconds per strategy check (forward, backward, parameter gradients, collectives
counted, memory checked) on

  * the simulated backend (every rank of a check in one thread of this process, backends/stacked.py),
  * the gloo pool, warm (persistent worker processes, a case's strategies sent as one batch),
  * the bare local op, the floor: every rank's forward and backward on its shards (sliced
    before the clock starts), back to back in one thread, with no harness, collectives or
    comparison (what torch itself charges for the check's arithmetic; layouts whose op
    cannot run without their collectives are left out and counted),
  * PyTorch DTensor under LocalTensorMode (torch.distributed.tensor on a fake process group):
    the same op on the same reference values, each strategy's input and parameter layouts
    given as DTensor placements (mesh axis m sharding tensor dim d -> Shard(d), else
    Replicate), forward and backward, output and gradients reconciled and compared (layouts
    DTensor cannot run, or whose first check takes it over --dtensor-budget CPU seconds, are left
    out of its timing and counted),

and, in a row of its own labelled with the factor, dims and shapes, the same op and mesh on
the spec's first case with its free dims multiplied by --scale (scaled_case: the first input's
leading dims and the other inputs' dims that must match them, never a contracted or feature
dim; for linear and sum every leading dim) (simulated and bare only): the grid cases are small,
so their ratio is mostly what the check costs per call (Python, hand-overs between rank
threads); the larger shape shows what grows with the arithmetic (--scaled-only SPEC ...: specs
measured in that row alone),

then, on the first mesh, the fresh-processes-per-case baselines (the first --fresh-cases cases
of each spec, each on new gloo processes started, used for its batch and closed: spawned per
case, each importing torch, and a forkserver pool started per case) against one warm pool
running the same checks, and the pool start-up against a bare spawn of as many gloo
processes (each imports torch.distributed, joins a gloo group through a file store, and
reports back).  Every pass of a timed figure checks fresh copies of the strategies (a suite
checks each strategy object once, so nothing remembered per strategy object may flatter the
figure); what is built once per case (its reference, the FLOP count of each local call
signature, the views of the reference each layout's ranks slice, as the bare op slices its
shards before its clock starts) is built in the untimed warm-up pass, as a suite builds it once
for all the case's strategies.  Every figure is measured in this one run (ms per check of the median pass
over the checks, so a burst of other load moves it little) and the ratios between them are
printed; ``--json`` prints them as one JSON document instead.  The simulated check and the bare
op are also given in CPU time of this process (every thread's): on a machine other work keeps
busy, the wall clock charges each figure for the time it waited for a core, CPU time for the
work it did, so their ratio moves less with the load.

Usage: .venv/bin/python benchmarks/bench_verify.py [--meshes 2,2 2,2,2] [--specs linear sum]
       [--cases 1] [--fresh-cases 2] [--seconds 2] [--scale 4] [--skip-gloo] [--skip-dtensor] [--json]
       .venv/bin/python benchmarks/bench_verify.py --quick     # CI's smoke run (figures not for quoting)
A figure it cannot measure (no layout ran bare or under DTensor, no pass timed) ends the run
with exit status 1, never a row left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- bare gloo spawn
def _bare_rank(rank: int, world: int, store_path: str, conn) -> None:
    """One bare gloo process: import torch.distributed, join the group, say so, leave."""
    import datetime

    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    conn.send(rank)
    conn.recv()   # stay in the group until every rank has joined
    dist.destroy_process_group()


def bare_spawn_seconds(world: int) -> float:
    """Seconds until ``world`` freshly spawned gloo processes have all joined one group."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-bare-") as folder:
        return _spawn_and_join(ctx, world, folder)


def _spawn_and_join(ctx, world: int, folder: str) -> float:
    """Spawn the ranks on a FileStore in ``folder``, time until all joined, let them leave."""
    began = time.perf_counter()
    procs, conns = [], []
    for rank in range(world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_bare_rank, args=(rank, world, os.path.join(folder, "store"), child))
        proc.start()
        procs.append(proc)
        conns.append(parent)
    for conn in conns:
        conn.recv()
    seconds = time.perf_counter() - began
    for conn in conns:
        conn.send(None)
    for proc in procs:
        proc.join(30)
    return seconds


# ------------------------------------------------------------------------- measurements
class Unmeasured(Exception):
    """A figure this run could not measure: the benchmark fails rather than print a row without it."""


def _median_ms(pass_seconds: list[float], checks_per_pass: int) -> float:
    """Milliseconds per check of the median pass: a pass slowed by other load on the machine
    moves it less than it moves the mean."""
    if not pass_seconds:
        raise Unmeasured("no pass was timed")
    return statistics.median(pass_seconds) / checks_per_pass * 1e3


def distinct_layouts(strategies: list) -> list:
    """One strategy per layout set: ``verify_case`` checks strategies alike but in name once
    (a following op offers one per predecessor), so timing them all and dividing by their
    count would flatter the check against a floor that runs each layout once."""
    firsts: dict = {}
    for strategy in strategies:
        firsts.setdefault(strategy.layout_key(), strategy)
    return list(firsts.values())


def _fresh(strategies: list) -> list:
    """New strategy objects equal to ``strategies`` (what a suite hands the verifier: each
    strategy object checked once), so nothing remembered per strategy object flatters a pass."""
    return pickle.loads(pickle.dumps(strategies))


def ms_per_check(backend, cases_and_strategies, min_seconds: float) -> tuple[float, int, float]:
    """Verify every (case, strategies) pass after pass, after one warm-up pass, for at least
    ``min_seconds``; every check must pass.  Each pass checks fresh copies of the strategies
    (made before the pass's clock starts).  ms per check of the median pass, checks timed, and
    the CPU ms per check of this process (every thread's; a process pool's workers not counted)
    of the median pass by CPU time."""
    from shardverify.verify.engine import verify_case
    from shardverify.verify.report import assert_passed

    for case, strategies in cases_and_strategies:
        assert_passed(verify_case(backend, case, strategies))
    passes, cpu, per_pass, start = [], [], sum(len(s) for _, s in cases_and_strategies), time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(passes) < 3:
        batch = [(case, _fresh(strategies)) for case, strategies in cases_and_strategies]
        began, began_cpu = time.perf_counter(), time.process_time()
        for case, strategies in batch:
            assert_passed(verify_case(backend, case, strategies))
        passes.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
    return _median_ms(passes, per_pass), per_pass * len(passes), _median_ms(cpu, per_pass)


def _placements(spec, mesh_ndim: int):
    from torch.distributed.tensor import Replicate, Shard

    owner = {axis: dim for dim, axes in spec.dim_partition for axis in axes}
    return [Shard(owner[m]) if m in owner else Replicate() for m in range(mesh_ndim)]


def _plain(tensor):
    """One tensor from every rank's identical copy (a LocalTensor), or the tensor itself."""
    return tensor.reconcile() if hasattr(tensor, "reconcile") else tensor


class _TooSlow(Exception):
    pass


@contextlib.contextmanager
def _budget(seconds: float):
    """Raise _TooSlow in this (the main) thread once ``seconds`` of CPU time have passed (a loaded
    machine's waits do not count: they would leave out layouts that need little work), but only
    while this file's own code runs: raised inside torch (Python code torch's C++ called, LocalTensorMode's
    dispatch), the exception crosses a C++ frame that cannot pass it on and the process aborts
    ("terminate called after throwing ... _TooSlow"). Until this file's code runs again the alarm
    re-arms every 10 ms, so a layout is cut between DTensor calls; past 3 x ``seconds`` it is cut
    wherever it is (waiting for the bench's code made (2,2,2) runs take far longer)."""
    from shardverify.backends.signals import deadline

    here = os.path.abspath(__file__)
    with deadline(seconds, lambda: _TooSlow(f"over {seconds:g} CPU s"), hard_after=3 * seconds, cpu=True,
                  only_where=lambda frame: frame is not None and os.path.abspath(frame.f_code.co_filename) == here):
        yield


def _mode_stacks() -> tuple[int, int]:
    """The depths of this thread's torch dispatch mode stack and of LocalTensorMode's own list."""
    import torch
    from torch.distributed._local_tensor import get_local_tensor_mode_list

    return torch._C._len_torch_dispatch_stack(), len(get_local_tensor_mode_list())


def _restore_mode_stacks(depths: tuple[int, int]) -> None:
    """Back to ``depths`` (:func:`_mode_stacks`): a layout cut by the budget's hard limit inside
    LocalTensorMode's own enter or exit leaves it entered (its DeviceMesh and RNG functions
    patched, its dispatch on this thread), and every tensor made after it, the bare op's and the
    fresh-processes baseline's, was a LocalTensor (seen once: the bare op 5x slower, then
    "Cannot convert local tensor to list")."""
    import torch
    from torch.distributed._local_tensor import get_local_tensor_mode_list
    from torch.utils._python_dispatch import _pop_mode

    dispatch, local = depths
    modes = get_local_tensor_mode_list()
    while len(modes) > local:
        modes.pop().disable_()
    while torch._C._len_torch_dispatch_stack() > dispatch:
        _pop_mode()


def dtensor_ms_per_check(mesh_shape, cases_and_strategies, min_seconds: float,
                         budget: float = 2.0) -> tuple[float, int, int]:
    """DTensor LocalTensorMode on the same ops, values and layouts (see the module docstring):
    ms per check, checks timed, and how many layouts were left out of the timing because
    DTensor cannot run them or needs over ``budget`` CPU seconds for its first check of them
    (its sharding propagation searches redistribution paths, which explodes on 3-D meshes)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import DeviceMesh, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardverify.capture.call import as_outputs, call_op
    from shardverify.verify.reference import reference

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)   # "suboptimal" notes
    world = 1
    for size in mesh_shape:
        world *= size
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = DeviceMesh("cpu", torch.arange(world).reshape(mesh_shape))

        def check(case, strategy) -> None:
            ref = reference(case, None, torch.device("cpu"))
            module = (ref.graph_module.get_submodule(ref.node.target) if ref.node.op == "call_module" else None)
            with LocalTensorMode(frozenset(range(world))):
                leaves = {}
                for data in strategy.inputs:
                    loc = (data.locator.kind, data.locator.key)
                    spec = strategy.get_sharding_spec_by_name(data.name)
                    value = distribute_tensor(ref.typed(loc), mesh, _placements(spec, len(mesh_shape)))
                    leaves[loc] = value.requires_grad_() if value.is_floating_point() else value
                outputs = as_outputs(ref.node, call_op(ref.node, module, leaves))
                grad_outs = [distribute_tensor(g.to(out.dtype), mesh, out.placements)
                             for out, g in zip(outputs, ref.grad_outputs)]
                wanted = [loc for loc, leaf in leaves.items() if leaf.requires_grad]
                grads = torch.autograd.grad(outputs, [leaves[loc] for loc in wanted], grad_outs)
                full_out = [out.full_tensor() for out in outputs]
                full_grads = [g.full_tensor() for g in grads]
            for got, want in zip(full_out, ref.outputs):
                torch.testing.assert_close(_plain(got).double(), want, rtol=1e-5, atol=1e-4)
            for loc, got in zip(wanted, full_grads):
                torch.testing.assert_close(_plain(got).double(), ref.grads[loc], rtol=1e-5, atol=1e-4)

        runnable, refused = [], 0
        for case, strategies in cases_and_strategies:   # warm-up: DTensor caches sharding propagation
            for strategy in strategies:
                modes = _mode_stacks()
                try:
                    with _budget(budget):
                        check(case, strategy)
                except Exception as exc:  # noqa: BLE001 - a layout DTensor cannot run (e.g. a view of a doubly sharded dim)
                    _restore_mode_stacks(modes)
                    if os.environ.get("BENCH_DEBUG"):
                        print(strategy.name, type(exc).__name__, str(exc).splitlines()[0][:200], file=sys.stderr)
                    refused += 1
                else:
                    runnable.append((case, strategy))
        if not runnable:
            raise Unmeasured(f"DTensor ran none of the {refused} layouts (BENCH_DEBUG=1 says why)")
        passes, start = [], time.perf_counter()
        while runnable and (time.perf_counter() - start < min_seconds or len(passes) < 3):
            began = time.perf_counter()
            for case, strategy in runnable:
                check(case, strategy)
            passes.append(time.perf_counter() - began)
        return _median_ms(passes, max(len(runnable), 1)), len(runnable) * len(passes), refused
    finally:
        if _mode_stacks() != (0, 0):   # never left entered, whatever ended the measuring
            _restore_mode_stacks((0, 0))
        dist.destroy_process_group()


def floor_ms_per_check(mesh, cases_and_strategies, min_seconds: float) -> tuple[float, int, int, float]:
    """What torch itself charges for a check's arithmetic: for every strategy and rank, the
    rank's input shards cloned as leaves, the op on them, and its backward for the rank's
    shard of the reference output gradient, back to back in this thread, with nothing else
    (no harness, no collectives, no comparison; the shards are sliced before the clock
    starts).  ms per check, checks timed, how many layouts were left out (those whose op
    cannot run without its declared collectives: a shard the op cannot take, an output the
    gradient shard does not fit), and the CPU ms per check of the median pass by CPU time."""
    import torch

    from shardverify.verify.rank import _private_module, local_arguments
    from shardverify.capture.call import as_outputs, call_op
    from shardverify.verify.reference import reference

    def prepared(case, strategy) -> list:
        """Per rank: (node, module, input shards by locator, argument values, grad-output shards)."""
        ref = reference(case, None, torch.device("cpu"))
        module = _private_module(ref, 0) if ref.node.op == "call_module" else None   # this thread's copy, as a rank's
        ranks = []
        for rank in range(mesh.size):
            shards = {(d.locator.kind, d.locator.key): strategy.get_sharding_spec_by_name(d.name).local_shard(
                ref.typed((d.locator.kind, d.locator.key)), mesh, rank) for d in strategy.inputs}
            grads = [strategy.get_sharding_spec_by_name(d.name).local_shard(g, mesh, rank)
                     for d, g in zip(strategy.outputs, ref.grad_outputs)]
            ranks.append((ref.node, module, shards, local_arguments(strategy, rank), grads))
        return ranks

    def work(ranks: list) -> None:
        for node, module, shards, arguments, grads in ranks:
            local = {loc: t.clone() for loc, t in shards.items()}
            leaves = [t.requires_grad_() for t in local.values() if t.is_floating_point()]
            local.update(arguments)
            outputs = as_outputs(node, call_op(node, module, local, owned=module is not None))
            torch.autograd.grad(outputs, leaves, [g.to(out.dtype) for out, g in zip(outputs, grads)],
                                allow_unused=True)

    runnable, left_out = [], 0
    for case, strategies in cases_and_strategies:   # warm-up, and which layouts run bare
        for strategy in strategies:
            ranks = prepared(case, strategy)   # outside the try: a change of the harness's API fails the run
            try:
                work(ranks)
            except Exception:  # noqa: BLE001 - a layout whose op needs its collectives
                left_out += 1
            else:
                runnable.append(ranks)
    if not runnable:
        raise Unmeasured(f"the bare local op ran none of the {left_out} layouts")
    passes, cpu, start = [], [], time.perf_counter()
    while runnable and (time.perf_counter() - start < min_seconds or len(passes) < 3):
        began, began_cpu = time.perf_counter(), time.process_time()
        for ranks in runnable:
            work(ranks)
        passes.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
    return (_median_ms(passes, max(len(runnable), 1)), len(runnable) * len(passes), left_out,
            _median_ms(cpu, max(len(runnable), 1)))


def scaled_case(case, factor: int):
    """``case`` grown by ``factor`` on its free dims only (shardverify/spec/scaled.py: each leading
    dim of the first input, with the dims of other inputs it must match, never a contracted or
    feature dim, kept where the case still builds; for linear and sum every leading dim, as this
    row always had), and which dims grew, as ``Scaled(case, dims)``.  Unmeasured, naming the case
    and why each dim stayed, when none can grow."""
    from shardverify.errors import InvalidArgument
    from shardverify.spec.scaled import scale_case

    try:
        return scale_case(case, factor)
    except InvalidArgument as exc:
        raise Unmeasured(f"{case.op}: its first case cannot be grown x{factor}: {exc}") from exc


def fresh_vs_pool(mesh, cases_and_strategies, min_seconds: float) -> dict:
    """The same checks on fresh processes per case and on one warm pool.  Fresh processes are
    measured two ways: spawned per case (``start_method="spawn"``: every case starts its own
    processes, each importing torch and joining a new gloo group, as a test that spawns its
    ranks does), and a forkserver pool started per case (what a pool restart costs once this
    process has its forkserver).  Each is started, used for the case's batch and closed."""
    from shardverify.backends.process import ProcessBackend
    from shardverify.verify.engine import verify_case
    from shardverify.verify.report import assert_passed

    def per_case(start_method: str) -> tuple[float, int]:
        checks, start = 0, time.perf_counter()
        for case, strategies in cases_and_strategies:
            with ProcessBackend(mesh, backend="gloo", timeout=120, start_method=start_method) as backend:
                results = verify_case(backend, case, _fresh(strategies))
                assert_passed(results)
                checks += len(results)
        return (time.perf_counter() - start) / checks * 1e3, checks

    spawned, checks = per_case("spawn")
    restarted, _ = per_case("forkserver")
    with ProcessBackend(mesh, backend="gloo", timeout=120) as pool:
        pool.start()
        warm = ms_per_check(pool, cases_and_strategies, min_seconds)[0]
    return {"fresh_ms_per_check": spawned, "fresh_checks": checks, "restarted_pool_ms_per_check": restarted,
            "warm_gloo_ms_per_check": warm, "fresh_over_warm": spawned / warm, "restarted_over_warm": restarted / warm}


def scaled_row(spec, mesh, factor: int, seconds: float) -> dict:
    """The simulated check against the bare op on the spec's first case scaled by ``factor``
    (:func:`scaled_case`), every distinct layout of it."""
    from shardverify.backends import SimulatedBackend
    from shardverify.strategies.for_node import strategies_for_node

    _, first = next(iter(spec.op_cases()))
    grown = scaled_case(first, factor)
    case = grown.case
    graph_module, node_name = case.build()
    chosen = [(case, distinct_layouts(strategies_for_node(graph_module, node_name, mesh)))]
    big = {"factor": factor, "dims": grown.describe(), "shapes": [list(decl.shape) for decl in case.inputs],
           "strategies": len(chosen[0][1])}
    with SimulatedBackend(mesh, timeout=120) as simulated:
        big["simulated_ms"], big["simulated_checks"], big["simulated_cpu_ms"] = ms_per_check(simulated, chosen, seconds)
    big["floor_ms"], big["floor_checks"], big["floor_left_out"], big["floor_cpu_ms"] = floor_ms_per_check(
        mesh, chosen, seconds)
    big["simulated_over_floor"] = big["simulated_ms"] / big["floor_ms"]
    big["simulated_over_floor_cpu"] = big["simulated_cpu_ms"] / big["floor_cpu_ms"]
    return big


def _scaled_text(big: dict) -> str:
    """The figures of a larger-shape row (:func:`scaled_row`) as printed."""
    return (f"x{big['factor']} on {big['dims']} {big['shapes']}, {big['strategies']} distinct layouts: simulated "
            f"{big['simulated_ms']:.2f} ms/check (the bare local op {big['floor_ms']:.2f} ms: "
            f"{big['simulated_over_floor']:.1f}x; by CPU time {big['simulated_cpu_ms']:.2f} against "
            f"{big['floor_cpu_ms']:.2f} ms: {big['simulated_over_floor_cpu']:.1f}x; {big['floor_left_out']} layouts it "
            f"cannot run bare left out)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=["2,2", "2,2,2"], help="mesh shapes, e.g. 2,2 2,2,2")
    parser.add_argument("--specs", nargs="+", default=["linear", "sum"])
    parser.add_argument("--cases", type=int, default=1, help="cases per spec (the first N of its grid)")
    parser.add_argument("--fresh-cases", type=int, default=2,
                        help="cases per spec in the fresh-processes-per-case baseline (first mesh only; 0 "
                             "leaves the baseline out)")
    parser.add_argument("--seconds", type=float, default=2.0, help="minimum measuring time per figure")
    parser.add_argument("--scale", type=int, default=4,
                        help="factor on the first case's free dims for the larger-shape row of each op and mesh "
                             "(simulated against the bare op; 1 leaves the row out; default 4)")
    parser.add_argument("--scaled-only", nargs="*", default=[],
                        help="specs measured only in the larger-shape row, on the first mesh (a case whose "
                             "contracted dim must not grow, e.g. matmul)")
    parser.add_argument("--skip-gloo", action="store_true", help="no process pools (no start-up, no fresh baseline)")
    parser.add_argument("--skip-dtensor", action="store_true", help="no DTensor LocalTensorMode figures")
    parser.add_argument("--dtensor-budget", type=float, default=2.0,
                        help="CPU seconds DTensor may take for its first check of a layout before the layout is "
                             "left out (default 2; the machine's load does not count)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the text")
    parser.add_argument("--quick", action="store_true",
                        help="CI's smoke run: every figure once, briefly (mesh 2,2 only, the sum spec's first case, "
                             "0.2 s per figure, the larger-shape row at --scale 2, for matmul too, fresh-processes baseline "
                             "on one case); its ratios are not for quoting")
    args = parser.parse_args()
    if args.quick:
        args.meshes, args.specs, args.cases, args.seconds = ["2,2"], ["sum"], 1, 0.2
        args.fresh_cases, args.scale = min(args.fresh_cases, 1), min(args.scale, 2)
        args.scaled_only = args.scaled_only or ["matmul"]
    if args.cases < 1:
        parser.error(f"--cases must be at least 1, got {args.cases}")
    if args.scale < 1:
        parser.error(f"--scale must be at least 1, got {args.scale}")
    if args.scaled_only and args.scale < 2:
        parser.error("--scaled-only needs --scale of 2 or more")
    if args.fresh_cases < 0:
        parser.error(f"--fresh-cases must be 0 or more, got {args.fresh_cases}")

    import torch

    from shardverify.strategies.for_node import strategies_for_node
    from shardverify.backends import SimulatedBackend
    from shardverify.backends.process import ProcessBackend
    from shardverify.cli.verify_cmd import parse_mesh
    from shardverify.spec.catalogue import load_op_specs
    from shardverify.backends.gc_policy import tune_for_checking
    from shardverify.sharding.mesh import DeviceMesh

    torch.set_num_threads(1)
    tune_for_checking()   # the collector settings `shardverify verify` and the suite check under
    meshes = [DeviceMesh(parse_mesh(text)) for text in args.meshes]
    specs = load_op_specs(REPO, None, args.specs)
    report: dict = {"load_average": list(os.getloadavg()), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "figures": []}
    say = (lambda *a: None) if args.json else print
    say(f"load average {report['load_average']}, {report['cpus']} CPUs, torch {torch.__version__}")

    if not args.skip_gloo:   # first, while this process has started no pool (no forkserver yet)
        mesh = meshes[0]
        began = time.perf_counter()
        with ProcessBackend(mesh, backend="gloo", timeout=120) as pool:
            pool.start()
            first_start = time.perf_counter() - began
        began = time.perf_counter()
        with ProcessBackend(mesh, backend="gloo", timeout=120) as pool:
            pool.start()
            later_start = time.perf_counter() - began
        bare = bare_spawn_seconds(mesh.size)
        startup = {"mesh": list(mesh.shape), "pool_first_start_s": first_start, "pool_later_start_s": later_start,
                   "bare_spawn_s": bare, "first_over_bare": first_start / bare, "later_over_bare": later_start / bare}
        report["startup"] = startup
        say(f"pool start-up on {mesh.shape}: first {first_start:.2f}s (starting the forkserver included), later "
            f"{later_start:.2f}s; bare spawn of {mesh.size} gloo processes {bare:.2f}s "
            f"(ratios {startup['first_over_bare']:.2f}x, {startup['later_over_bare']:.2f}x)")

    for mesh in meshes:
        for spec in specs:
            chosen, offered_count = [], 0
            for _, case in list(spec.op_cases())[:args.cases]:
                graph_module, node_name = case.build()
                offered = list(strategies_for_node(graph_module, node_name, mesh))
                offered_count += len(offered)
                chosen.append((case, distinct_layouts(offered)))
            row = {"op": spec.name, "mesh": list(mesh.shape), "cases": len(chosen), "offered": offered_count,
                   "strategies": sum(len(s) for _, s in chosen)}
            with SimulatedBackend(mesh, timeout=120) as simulated:
                row["simulated_ms"], row["simulated_checks"], row["simulated_cpu_ms"] = ms_per_check(
                    simulated, chosen, args.seconds)
            row["floor_ms"], row["floor_checks"], row["floor_left_out"], row["floor_cpu_ms"] = floor_ms_per_check(
                mesh, chosen, args.seconds)
            row["simulated_over_floor"] = row["simulated_ms"] / row["floor_ms"]
            row["simulated_over_floor_cpu"] = row["simulated_cpu_ms"] / row["floor_cpu_ms"]
            if not args.skip_dtensor:
                row["dtensor_ms"], row["dtensor_checks"], row["dtensor_refused"] = dtensor_ms_per_check(
                    mesh.shape, chosen, args.seconds, args.dtensor_budget)
                row["dtensor_over_simulated"] = row["dtensor_ms"] / row["simulated_ms"]
            if not args.skip_gloo:
                with ProcessBackend(mesh, backend="gloo", timeout=120) as pool:
                    pool.start()
                    row["gloo_ms"], row["gloo_checks"], _ = ms_per_check(pool, chosen, args.seconds)
            if args.scale > 1:
                row["scaled"] = scaled_row(spec, mesh, args.scale, args.seconds)
            report["figures"].append(row)
            text = (f"{spec.name:8s} mesh {str(mesh.shape):10s} {row['strategies']:3d} distinct layouts "
                    f"({row['offered']} strategies offered): "
                    f"simulated {row['simulated_ms']:.2f} ms/check (the bare local op {row['floor_ms']:.2f} ms: "
                    f"{row['simulated_over_floor']:.1f}x; by CPU time {row['simulated_cpu_ms']:.2f} against "
                    f"{row['floor_cpu_ms']:.2f} ms: {row['simulated_over_floor_cpu']:.1f}x; {row['floor_left_out']} "
                    f"layouts it cannot run bare left out)")
            if "dtensor_ms" in row:
                text += (f", DTensor LocalTensorMode {row['dtensor_ms']:.1f} ms ({row['dtensor_over_simulated']:.0f}x; "
                         f"{row['dtensor_refused']} layouts it cannot run in time left out)")
            if "gloo_ms" in row:
                text += f", gloo pool warm {row['gloo_ms']:.2f} ms/check"
            say(text)
            if "scaled" in row:
                big = row["scaled"]
                say(f"{'':8s} {'':16s} {_scaled_text(big)}; the check's CPU time over the bare op's: "
                    f"{row['simulated_cpu_ms'] - row['floor_cpu_ms']:.2f} ms per check at the grid shape, "
                    f"{big['simulated_cpu_ms'] - big['floor_cpu_ms']:.2f} ms here")

    for spec in load_op_specs(REPO, None, args.scaled_only) if args.scaled_only else []:
        big = scaled_row(spec, meshes[0], args.scale, args.seconds)
        report.setdefault("scaled_only", []).append({"op": spec.name, "mesh": list(meshes[0].shape), **big})
        say(f"{spec.name:8s} mesh {str(meshes[0].shape):10s} {_scaled_text(big)}")

    if not args.skip_gloo and args.fresh_cases:
        mesh = meshes[0]
        baseline = []
        for spec in specs:
            for _, case in list(spec.op_cases())[:args.fresh_cases]:
                graph_module, node_name = case.build()
                baseline.append((case, distinct_layouts(strategies_for_node(graph_module, node_name, mesh))))
        fresh = fresh_vs_pool(mesh, baseline, args.seconds)
        report["fresh_processes"] = fresh
        say(f"fresh processes per case on {mesh.shape} ({fresh['fresh_checks']} checks): spawned per case "
            f"{fresh['fresh_ms_per_check']:.1f} ms/check, a forkserver pool started per case "
            f"{fresh['restarted_pool_ms_per_check']:.1f}, against a warm pool's {fresh['warm_gloo_ms_per_check']:.2f} "
            f"on the same checks: {fresh['fresh_over_warm']:.0f}x and {fresh['restarted_over_warm']:.1f}x")
    report["load_average_after"] = list(os.getloadavg())
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(f"load average after: {report['load_average_after']}")


if __name__ == "__main__":
    try:
        main()
    except Unmeasured as exc:
        sys.exit(f"bench_verify: a figure could not be measured: {exc}")
