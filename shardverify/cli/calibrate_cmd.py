"""`shardverify calibrate --backend gloo [--mesh 2,2] [--out FILE]`: measure each mesh axis'
alpha and beta on the real backend, store them for ``DeviceMesh.calibrated``, and report how well
the calibrated costs rank the strategies of Linear against their measured communication times."""

from __future__ import annotations

import argparse
import json
import sys

from shardverify.backends import registry
from shardverify.cli import USAGE
from shardverify.cli.verify_cmd import parse_bounded_mesh, parse_positive_int
from shardverify.errors import ShardVerifyError

#: the Linear whose strategies are ranked: big enough that bytes, not only latency, count
RANK_IN, RANK_OUT, RANK_INPUT = 512, 1024, (8, 64, 512)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="measure the alpha-beta cost model of each mesh axis on a real backend",
        description="Time all-reduces and all-gathers over each mesh axis on a real backend, fit the "
                    "mesh's alpha-beta model by least squares, write the figures where "
                    "DeviceMesh.calibrated() loads them, and rank the strategies of Linear by "
                    "calibrated cost against their measured communication times (Spearman).")
    names = registry.backend_names(registry.measures)   # real collectives on any mesh
    parser.add_argument("--backend", choices=names, default="gloo", help=registry.backend_help(names))
    parser.add_argument("--mesh", type=parse_bounded_mesh, default=(2, 2), metavar="SHAPE", help="mesh shape (default: 2,2)")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="calibration file (default: $SHARDVERIFY_CALIBRATION or "
                             "~/.cache/shardverify/calibration.json); other meshes' entries are kept")
    parser.add_argument("--max-bytes", type=parse_positive_int, default=4 << 20, metavar="B",
                        help="largest payload timed, per rank (default: 4 MiB; sizes are powers of 4 from 1 KiB)")
    parser.add_argument("--repeats", type=parse_positive_int, default=10, metavar="N", help="timed runs per point (median)")
    parser.add_argument("--no-rank", action="store_true", help="skip ranking Linear's strategies")
    parser.add_argument("--json", action="store_true", help="print a JSON document")
    parser.set_defaults(func=run)


def payload_sizes(max_bytes: int) -> list[int]:
    sizes, size = [], 1024
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def rank_linear(backend, mesh, repeats: int) -> dict:
    """Calibrated cost against measured time of every Linear strategy's collectives (fwd + bwd)."""
    from shardverify.strategies.for_node import strategies_for_node
    from shardverify.backends.calibration import replay_times, spearman
    from shardverify.strategies.generators.common import action_traffic, communication_cost
    from shardverify.sharding.mesh import DeviceMesh
    from shardverify.spec.case import InputDecl, ModuleDecl, OpCase

    case = OpCase(op="linear", target="torch.nn.Linear", inputs=(InputDecl("input", RANK_INPUT),),
                  module=ModuleDecl("torch.nn.Linear", (RANK_IN, RANK_OUT), (("bias", False),)))
    graph_module, node_name = case.build()
    strategies = list(strategies_for_node(graph_module, node_name, mesh))
    plans = []
    for s in strategies:
        traffic = action_traffic(mesh, s.communication_actions, {d.name: d for d in s.operands},
                                 dict(s.sharding_specs))
        plans.append([(kind, axes, size) for _, kind, axes, size in traffic])
    measured = replay_times(backend, plans, repeats=repeats)
    predicted = [s.communication_cost.total for s in strategies]
    default = DeviceMesh(mesh.shape)   # the same strategies priced with the uncalibrated defaults
    uncalibrated = [communication_cost(default, s.communication_actions, {d.name: d for d in s.operands},
                                       dict(s.sharding_specs)).total for s in strategies]
    rows = [{"strategy": s.name, "predicted_s": p, "measured_s": m}
            for s, p, m in zip(strategies, predicted, measured)]
    return {"case": case.describe(), "spearman": spearman(predicted, measured),
            "spearman_uncalibrated": spearman(uncalibrated, measured), "strategies": rows}


def run(args: argparse.Namespace) -> int:
    from shardverify.backends import get_backend
    from shardverify.backends.calibration import fit_mesh, measure, measure_rate, save_calibration
    from shardverify.sharding.mesh import DeviceMesh

    if args.repeats < 1 or args.max_bytes < 1024:
        print("shardverify calibrate: --repeats must be >= 1 and --max-bytes >= 1024", file=sys.stderr)
        return USAGE
    try:
        mesh = DeviceMesh(args.mesh)
        if mesh.size < 2:
            raise ShardVerifyError(f"mesh {args.mesh} has one rank: nothing to calibrate")
        backend = get_backend(args.backend, mesh, timeout=600)
        try:
            samples = measure(backend, payload_sizes(args.max_bytes), repeats=args.repeats)
            fits = fit_mesh(mesh.shape, samples)
            rate = measure_rate(backend)     # the arithmetic the `calibrated` device profile times nodes by
            dist, device = registry.wires(backend, args.backend)   # the collectives measured
            path = save_calibration(mesh.shape, fits, backend=dist, device=device, path=args.out,
                                    multiply_adds_per_s=rate)
            calibrated = DeviceMesh.calibrated(mesh.shape, path=str(path))
            ranking = None if args.no_rank else rank_linear(backend, calibrated, args.repeats)
        finally:
            backend.close()
    except ShardVerifyError as exc:
        print(f"shardverify calibrate: {exc}", file=sys.stderr)
        return 1
    report = {"mesh": list(mesh.shape), "backend": args.backend, "file": str(path), "multiply_adds_per_s": rate,
              "axes": [{"axis": f.axis, "alpha_s": f.alpha, "beta_s_per_byte": f.beta, "rel_rms": f.rel_rms,
                        "points": f.points} for f in fits],
              "samples": [{"axis": s.axis, "kind": s.kind, "payload_bytes": s.payload, "seconds": s.seconds}
                          for s in samples],
              "ranking": ranking}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"mesh {mesh.shape} on {args.backend}: written to {path}")
    for f in fits:
        bandwidth = f"{1 / f.beta / 1e9:.3g} GB/s" if f.beta else "inf"
        print(f"  axis {f.axis}: alpha {f.alpha * 1e6:.3g} us, beta {f.beta:.3g} s/B ({bandwidth}), "
              f"fit rel. RMS error {f.rel_rms:.2f} over {f.points} timings")
    print(f"  arithmetic: {rate:.3g} multiply-adds/s (the slowest rank's float32 matmul); "
          f"plan --device calibrated uses these figures")
    if ranking is not None:
        print(f"Linear strategies, {ranking['case']}: calibrated cost vs measured communication time")
        for row in sorted(ranking["strategies"], key=lambda r: r["predicted_s"]):
            print(f"  {row['strategy']:<24} predicted {row['predicted_s'] * 1e3:8.3f} ms   "
                  f"measured {row['measured_s'] * 1e3:8.3f} ms")
        print(f"Spearman rank correlation: {ranking['spearman']:.3f} "
              f"(default alpha/beta: {ranking['spearman_uncalibrated']:.3f})")
    return 0
