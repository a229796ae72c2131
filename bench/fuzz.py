"""The long fuzzed parity run: generated small transformers under every valid strategy on 2 and 4
gloo ranks against one process (the CI run of the same generators is tests/test_fuzz.py).

Each example draws a mesh, a model of ``tests/fuzz_models.py`` that mesh can run and the rest of
a ``gp.Strategy`` (tests/test_fuzz.py's Hypothesis strategies), compiles it on a live pool of
ranks, trains it 3 SGD-with-momentum steps and compares the losses and ``full_state_dict()`` with
one process at the suite's tolerances (rtol 1e-5 / atol 1e-6). A failure does not stop the run:
it prints the example (model, strategy, batch), the Hypothesis seed and the example's number,
and a ``--case`` line that replays it alone. The summary counts the examples by mesh and
schedule and by option, and lists the failures.

    python bench/fuzz.py --examples 500 --seed 7         # half on 2 ranks, half on 4
    python bench/fuzz.py --examples 100 --world-sizes 4
    python bench/fuzz.py --case '{"world_size": 2, ...}'  # replay one failure

The CI runs a few examples on every mesh; here the mesh is drawn too, so a long run spreads over
meshes, schedules and options in proportion to how many strategies each allows. One example takes
~1 s on 2 ranks and ~2.5 s on 4 ranks of this 2-core machine when it is quiet (mostly export on
every rank): 500 examples take about 15 minutes. The ranks log graphpass's warnings (recompute
splitting a layer at a collective, ops without a tensor-parallel rule) on stderr.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "examples"))
sys.path.insert(0, os.path.join(_HERE, "..", "tests"))

from hypothesis import given, seed  # noqa: E402

from graphpass.runtime.launch import RankPool  # noqa: E402

import test_fuzz  # noqa: E402  (tests/ is not a package)
from test_fuzz import FuzzCase, check_case, fuzz_cases, fuzz_settings, kind, mesh_kind, options  # noqa: E402

#: a pool is restarted after this many examples: every compile makes new process groups, whose
#: sockets a long run would otherwise pile up in the ranks
POOL_EXAMPLES = 100


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=500, help="examples in all, shared among the world sizes")
    p.add_argument("--seed", type=int, default=test_fuzz.SEED, help="Hypothesis seed (default: the CI's)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    p.add_argument("--timeout-s", type=float, default=300, help="limit on one example's run on the ranks")
    p.add_argument("--case", help="replay one example, given as the JSON a failure prints")
    return p.parse_args(argv)


class _Pool:
    """A RankPool restarted every ``POOL_EXAMPLES`` runs."""

    def __init__(self, world_size: int):
        self.world_size, self.runs, self.pool = world_size, 0, RankPool(world_size)

    def run(self, fn, *args, timeout_s: float):
        if self.runs and self.runs % POOL_EXAMPLES == 0:
            self.pool.close()
            self.pool = RankPool(self.world_size)
        self.runs += 1
        return self.pool.run(fn, *args, timeout_s=timeout_s)

    def close(self) -> None:
        self.pool.close()


def _replay(text: str, timeout_s: float) -> int:
    case = FuzzCase.from_json(text)
    print(case.describe())
    with RankPool(case.world_size) as pool:
        start = time.perf_counter()
        try:
            check_case(pool, case, seed_used=None, timeout_s=timeout_s)
        except AssertionError as exc:
            print(f"FAILED in {time.perf_counter() - start:.1f} s\n{exc}")
            return 1
    print(f"ok: matches one process ({time.perf_counter() - start:.1f} s)")
    return 0


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.case:
        return _replay(args.case, args.timeout_s)
    shares = [args.examples // len(args.world_sizes) + (i < args.examples % len(args.world_sizes))
              for i in range(len(args.world_sizes))]
    by_kind: collections.Counter = collections.Counter()
    by_option: collections.Counter = collections.Counter()
    failures: list[str] = []
    run = 0
    start = time.perf_counter()
    where = ", ".join(f"{n} on {w} ranks" for w, n in zip(args.world_sizes, shares))
    print(f"fuzz: {args.examples} examples ({where}), hypothesis seed {args.seed}")
    for world_size, count in zip(args.world_sizes, shares):
        pool = _Pool(world_size)
        index = 0

        @fuzz_settings(count)
        @seed(args.seed)
        @given(case=fuzz_cases(world_size))
        def one_example(case: FuzzCase) -> None:
            nonlocal index, run
            index += 1
            run += 1
            by_kind[f"{world_size} ranks: {mesh_kind(case.strategy)}"] += 1
            by_option.update(option.rstrip("0123456789") if option.startswith(("split", "mb")) else option
                             for option in options(case.strategy))
            config = case.config
            by_option.update(f"model: {word}" for word in (
                config.norm, config.activation, config.attention, f"{config.position} positions",
                "tied head" if config.tied else "untied head", "bias" if config.bias else "no bias",
                "MHA" if config.kv_heads == config.heads else "MQA" if config.kv_heads == 1 else "GQA"))
            began = time.perf_counter()
            try:
                check_case(pool, case, args.seed, timeout_s=args.timeout_s)
                verdict = "ok"
            except AssertionError as exc:
                verdict = "FAILED"
                failures.append(f"example {index} on {world_size} ranks (hypothesis seed {args.seed}):\n{exc}")
                print(f"\n{failures[-1]}\n", flush=True)
            print(f"[{index:4d}/{count}] {world_size} ranks  {kind(case.strategy):45s} {case.config.short():70s} "
                  f"b{case.batch:<3d} {verdict} {time.perf_counter() - began:5.1f} s", flush=True)

        try:
            one_example()
        finally:
            pool.close()

    print(f"\n{run} examples in {time.perf_counter() - start:.0f} s, {len(failures)} failed")
    print("by mesh (and schedule):")
    for name, n in sorted(by_kind.items()):
        print(f"  {name:50s} {n:5d}")
    print("by option:")
    for name, n in sorted(by_option.items()):
        print(f"  {name:50s} {n:5d}")
    for failure in failures:
        print(f"\n{failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
