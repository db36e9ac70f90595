"""`shardverify verify --opinfo`: every op spec served on PyTorch's OpInfo samples of its targets.

Each sample is captured with torch.fx and torch.export and served on each mesh as a plan serves a
call (the grid's strategies, or those verified on demand); every strategy served on the grid is
verified at the call too. Exit 1 when a served strategy is wrong at a call or a call raised a raw
exception where a reason was owed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from shardverify.errors import ShardVerifyError

__all__ = ["run_opinfo"]


def run_opinfo(args: argparse.Namespace, specs: list) -> int:
    from shardverify.opinfo.report import HEADER, markdown, table
    from shardverify.opinfo.sweep import SweepResult, sweep_spec
    from shardverify.verify.on_demand import OnDemandVerifier

    meshes = args.mesh or [(2, 2), (4,)]
    total = SweepResult()
    try:
        with OnDemandVerifier() as verifier:
            for spec in specs:
                print(f"opinfo: {spec.name} ...", file=sys.stderr, flush=True)
                found = sweep_spec(spec, meshes, limit=args.opinfo_samples, verifier=verifier)
                total.outcomes += found.outcomes
                total.seconds += found.seconds
            total.defects = [r.defect() for r in verifier.records if r.failed]
    except ShardVerifyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nshardverify verify --opinfo: interrupted; exit 130", file=sys.stderr)
        return 130
    ops = [spec.name for spec in specs]
    rows = table(ops, total)
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    for row in [HEADER, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if args.report is not None:
        command = "shardverify verify --opinfo" + (f" --opinfo-samples {args.opinfo_samples}")
        Path(args.report).write_text(markdown(ops, total, command, torch.__version__), encoding="utf-8")
        print(f"report written to {args.report}")
    for defect in total.defects:
        print(f"rule defect (not offered): {defect}")
    raw = [o for o in total.outcomes if o.outcome == "raw-error"]
    for o in raw[:20]:
        print(f"raw exception: {o.op} {o.sample} [{o.capture}, mesh {o.mesh}]: {o.reason}")
    for o in total.wrong:
        print(f"WRONG: {o.op} {o.sample} [{o.capture}, mesh {o.mesh}]: {', '.join(o.wrong)}")
    for o in [o for o in total.outcomes if o.wrong_extremum]:
        print(f"wrong partial max/min (plans never serve these): {o.op} {o.sample} [{o.capture}, mesh {o.mesh}]: "
              f"{', '.join(o.wrong_extremum)}")
    counts = total.counts()
    print(f"\n{sum(counts.values())} calls: " + ", ".join(f"{n} {k}" for k, n in counts.most_common())
          + f"; {total.seconds:.0f}s")
    return 1 if total.wrong or raw else 0
