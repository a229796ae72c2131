"""Measure this machine: device throughput, the alpha-beta of its links, and per-op times.

The cost model prices a plan from a `Cluster` (figures per device and per link) and from per-node
compute times (`graphpass.cost.compute.graph_compute`). Presets and `Cluster.local`'s defaults are
spec-sheet or guessed figures; this package replaces them with measurements, all cached under
`graphpass.cluster.cache_dir` (``$GRAPHPASS_CACHE_DIR``, else ``~/.cache/graphpass``):

* `timing`: the timing primitives (medians after warmup, timing on every rank at once), the
  device's matmul and copy rates, the optimizer step's cost.
* `cluster`: `profile` / `run_profile`, which measure the device, the ranks' contention and the
  links and write the `Cluster` that `Cluster.local` loads.
* `op_times`: `node_times`, each op of a graph timed alone and cached by `op_key`, and
  `isolation_factor`, which scales those times to the whole graph's.

Example::

    cluster = graphpass.profile(world_size=2)        # writes clusters/cpu-2.json; logs a summary
    Cluster.local(2) == cluster                      # later jobs load it
    times = node_times(gm, cluster.device, measure=True)
    costs = graph_compute(gm, cluster.device, "fp32", measured=times)
"""

from graphpass.cost.profiler.cluster import ProfileReport, fit_ring_all_reduce, profile, profile_path, run_profile
from graphpass.cost.profiler.op_times import is_this_machine, isolation_factor, node_times, op_cache_path, op_key
from graphpass.cost.profiler.timing import optimizer_step_times, together_median_s

__all__ = [
    "ProfileReport",
    "fit_ring_all_reduce",
    "is_this_machine",
    "isolation_factor",
    "node_times",
    "op_cache_path",
    "op_key",
    "optimizer_step_times",
    "profile",
    "profile_path",
    "run_profile",
    "together_median_s",
]
