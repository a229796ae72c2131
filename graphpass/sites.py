"""Clusters of clusters: sites joined by a wide-area link (Nebula-I's setting).

A *site* is an ordinary homogeneous :class:`~graphpass.cluster.Cluster` (its device, nodes and
two link levels); :meth:`Cluster.join` puts two or more of them behind one wide-area link into
a single cluster whose ranks are site-major (site 0's ranks first), so the mesh knows which ranks
share a site (:meth:`Cluster.site_of`) and which axes' groups cross the link
(:meth:`Cluster.crosses_sites`)::

    wan = gp.Link(bandwidth="10 Gbit/s", latency="20 ms")       # or the preset: gp.Link("wan-10g")
    cluster = gp.Cluster.join(gp.Cluster.preset("h100-80g", 4), gp.Cluster.preset("a100-80g", 4), link=wan)
    gp.plan(model, "h100-80g:4x8+a100-80g:4x8@wan-10g", ...)    # the same, as a string

Unlike a node's per-GPU links, a wide-area link's bandwidth is the sites' aggregate: every
group that crosses it at once shares it (:mod:`graphpass.cost.collectives` divides it among
them). Sites must have the same devices per node and backend; their devices and node counts may
differ. What is priced per site: a group inside one site runs on that site's links; the joined
cluster's ``device`` is the slowest site's (the smallest memory of any), which blocks are priced
on, and per-site work follows each rank's device (:meth:`Cluster.relative_speed`): the planner's
data-parallel shares, and pipeline stages sized to their devices' speed and memory
(``graphpass.cost.search.stages``). ``explain()`` says which. ``docs/sites.md`` has the design.
"""

from __future__ import annotations

import re
from typing import Any

from graphpass.cluster import Cluster, LinkSpec

_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

#: wide-area links by name: (bits per second, one-way latency). 1 and 10 Gbit/s at 20 ms are
#: issue 41's emulated links (a regional WAN: 20 ms one way is ~4,000 km of fibre at 2/3 c);
#: 100 Gbit/s at 10 ms a leased research link between nearby sites; 75 ms one way is a
#: transatlantic path (RTT about 150 ms with routing).
WAN_PRESETS: dict[str, tuple[float, float]] = {
    "wan-1g": (1e9, 20e-3),
    "wan-10g": (10e9, 20e-3),
    "wan-100g": (100e9, 10e-3),
    "transatlantic-10g": (10e9, 75e-3),
}


def _bits_per_s(value: Any) -> float | None:
    """Bits per second from a number (bits per second) or a rate with its unit: ``bit/s``,
    ``b/s`` or ``bps`` are bits, ``B/s`` bytes, after a k, M, G or T prefix."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = isinstance(value, str) and re.fullmatch(
        r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([kKmMgGtT]?)(bit/s|b/s|bps|B/s)\s*", value)
    if not match:
        return None
    return float(match.group(1)) * _PREFIXES[match.group(2).lower()] * (8.0 if match.group(3) == "B/s" else 1.0)


def _seconds(value: Any) -> float | None:
    """Seconds from a number or a duration with its unit (``s``, ``ms``, ``us``, ``ns``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = isinstance(value, str) and re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*(s|ms|us|µs|ns)\s*",
                                                   value, re.IGNORECASE)
    return float(match.group(1)) * _TIME_UNITS[match.group(2).lower()] if match else None


def Link(bandwidth: float | str, latency: float | str | None = None, name: str | None = None) -> LinkSpec:  # noqa: N802
    """A wide-area link between sites, as a :class:`~graphpass.cluster.LinkSpec`.

    Args:
        bandwidth: What the sites exchange in each direction over the link, all their devices
            together: bits per second, or a string with a unit (``"10 Gbit/s"``, ``"400Mbps"``,
            ``"1.25 GB/s"``); or the name of a :data:`WAN_PRESETS` link (``gp.Link("wan-10g")``).
        latency: One-way latency: seconds, or a string (``"20 ms"``, ``"500us"``); default 0,
            or the preset's.
        name: Its label in summaries (default ``"wan"``, or the preset's name).

    Raises:
        ValueError: A missing, zero or negative bandwidth, a negative latency, an unknown unit.
    """
    if isinstance(bandwidth, str) and bandwidth in WAN_PRESETS:
        bits, seconds = WAN_PRESETS[bandwidth]
        return Link(bits, seconds if latency is None else latency, name or bandwidth)
    latency, name = (0.0 if latency is None else latency), (name or "wan")
    bits = _bits_per_s(bandwidth)
    if bits is None or not 0 < bits < float("inf"):
        raise ValueError(f"Link.bandwidth={bandwidth!r}: give the link's rate as a positive number of bits per "
                         "second, a string with a unit, e.g. '10 Gbit/s', '400Mbps', '1.25 GB/s', or a preset: "
                         f"{sorted(WAN_PRESETS)}")
    seconds = _seconds(latency)
    if seconds is None or not 0 <= seconds < float("inf"):
        raise ValueError(f"Link.latency={latency!r}: give the one-way latency as seconds >= 0 or a string with a "
                         "unit, e.g. '20 ms', '500us'")
    return LinkSpec(bandwidth_gbps=bits / 8e9, latency_s=seconds, name=name)


def parse(text: str, preset) -> Cluster:
    """The string form ``SITE+SITE[+...]@LINK``: each site as ``preset`` reads it (``NAME`` or
    ``NAME:NODESxGPUS``), ``LINK`` a :data:`WAN_PRESETS` name or ``BANDWIDTH,LATENCY``
    (``"h100-80g:4x8+a100-80g:4x8@wan-10g"``, ``"...@1Gbit/s,20ms"``)."""
    if text.count("@") != 1:
        raise ValueError(f"cluster={text!r}: write joined sites as SITE+SITE@LINK, e.g. "
                         f"'h100-80g:4x8+a100-80g:4x8@wan-10g' (links: {sorted(WAN_PRESETS)} or '1Gbit/s,20ms')")
    sites_text, link_text = text.split("@")
    link_text = link_text.strip()
    if link_text in WAN_PRESETS:
        link = Link(link_text)
    else:
        bandwidth, _, latency = link_text.partition(",")
        link = Link(bandwidth, latency or 0.0, name=link_text)
    return Cluster.join(*(preset(part) for part in sites_text.split("+")), link=link)


def describe(cluster: Cluster, mesh, uneven: bool = False, stage_speeds=(), stage_blocks=(),
             stage_budgets=()) -> str | None:
    """The plan's line about its sites: the link, which mesh axes cross it, and what is priced
    for the slowest site (``uneven``: the plan's dp shares follow the devices' speeds;
    ``stage_speeds``: each pp rank's speed against the slowest device, where the pipeline
    crosses unlike sites, with ``stage_blocks`` blocks in each stage and ``stage_budgets``
    bytes each pp rank may hold); None for a cluster of one site."""
    if not cluster.sites:
        return None
    crossing = [axis for axis in mesh if mesh[axis] > 1 and cluster.crosses_sites(mesh, axis)]
    sites = ", ".join(f"{s.name or i} ({s.world_size} x {s.device.name})" for i, s in enumerate(cluster.sites))
    wan = cluster.wan
    devices = {s.device.name for s in cluster.sites}
    if uneven:
        work = "; dp shares follow the devices' speeds"
    elif len(set(stage_speeds)) > 1:
        work = ("; pipeline stages sized to their devices' speeds (" + ", ".join(
            f"stage {s}: {n} block{'s' if n > 1 else ''} at {v:.2f}x" for s, (n, v) in enumerate(zip(stage_blocks, stage_speeds)))
            + f" the {cluster.device.name}'s)")
    elif len(devices) > 1:
        work = f"; priced for the slowest site's device ({cluster.device.name}) on every rank"
    else:
        work = ""
    if len(set(stage_budgets)) > 1:
        work += ("; each pp rank's memory budget its own device's (" + ", ".join(f"{b / 2**30:.2f}" for b in stage_budgets)
                 + " GiB)")
    return (f"sites: {sites}, joined by {wan.name or 'a wide-area link'} ({wan.bandwidth_gbps * 8:g} Gbit/s shared, "
            f"{wan.latency_s * 1e3:g} ms); axes crossing it: {', '.join(crossing) or 'none'}" + work)


__all__ = ["Link", "WAN_PRESETS", "describe", "parse"]
