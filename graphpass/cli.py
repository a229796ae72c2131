"""The ``graphpass`` command line: inspect presets, plans and dumps without writing Python.

    graphpass presets                 # the cluster presets and their figures
    graphpass explain plan.json       # Plan.explain() of a saved plan
    graphpass dumps DIR               # summary.txt and the collectives in each rank's final graph
    graphpass profile --world-size 2  # measure this machine; Cluster.local(2) then loads it
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

from graphpass.cluster import Cluster, presets
from graphpass.plan import Plan

# fx prints a call to graphpass.runtime.<module>.<op> as graphpass_runtime_<module>_<op>(...).
_COLLECTIVE_RE = re.compile(r"graphpass_runtime_(?:collectives|grad_sync|zero|tensor_parallel)_(\w+)\(")


def _presets(_: argparse.Namespace) -> int:
    for name in presets():
        cluster = Cluster.preset(name, nodes=1, gpus_per_node=8)
        device = cluster.device
        print(
            f"{name:10s} {device.memory_bytes / 2**30:6.1f} GiB  bf16 {device.peak_tflops.get('bf16', 0):6.1f} TFLOP/s  "
            f"HBM {device.memory_bandwidth_gbps:6.0f} GB/s  | {cluster.explain()}"
        )
    return 0


def _explain(args: argparse.Namespace) -> int:
    path = pathlib.Path(args.plan)
    if not path.is_file():
        print(f"graphpass explain: no such plan file {path}", file=sys.stderr)
        return 2
    print(Plan.from_json(path.read_text()).explain())
    return 0


def _dumps(args: argparse.Namespace) -> int:
    root = pathlib.Path(args.dir)
    summary = root / "summary.txt"
    if not summary.is_file():
        print(f"graphpass dumps: {root} has no summary.txt (was it written with dump_dir=?)", file=sys.stderr)
        return 2
    print(summary.read_text().rstrip())
    for rank_dir in sorted(root.glob("rank*")):
        graphs = sorted(rank_dir.glob("*.py"))
        if not graphs:
            continue
        calls = _COLLECTIVE_RE.findall(graphs[-1].read_text())
        print(f"{rank_dir.name}: {graphs[-1].name}: collectives in order: {', '.join(calls) or 'none'}")
    return 0


def _profile(args: argparse.Namespace) -> int:
    from graphpass.cost.profiler import run_profile  # imports torch: only for this command

    dtypes = args.dtypes.split(",") if args.dtypes else None
    try:
        report = run_profile(world_size=args.world_size, path=args.out, dtypes=dtypes, quick=args.quick)
    except ValueError as exc:
        print(f"graphpass profile: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``graphpass`` console script."""
    parser = argparse.ArgumentParser(prog="graphpass", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("presets", help="list cluster presets").set_defaults(fn=_presets)
    p = sub.add_parser("explain", help="explain a saved plan.json")
    p.add_argument("plan")
    p.set_defaults(fn=_explain)
    p = sub.add_parser("dumps", help="summarise a dump directory")
    p.add_argument("dir")
    p.set_defaults(fn=_dumps)
    p = sub.add_parser("profile", help="measure this machine's device and links into a cluster JSON")
    p.add_argument("--world-size", type=int, default=1, help="local ranks to profile (default 1)")
    p.add_argument("--out", default=None, help="JSON path (default: where Cluster.local looks)")
    p.add_argument("--dtypes", default=None, help="comma-separated matmul dtypes, e.g. bf16,fp32")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (seconds)")
    p.set_defaults(fn=_profile)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
