"""Sizes for people: bytes in binary units."""

from __future__ import annotations


def format_bytes(num: float) -> str:
    """``num`` bytes in the largest binary unit it reaches: ``'1.5 GiB'``, ``'512 KiB'``, ``'12 B'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num) >= scale:
            return f"{num / scale:.3g} {unit}"
    return f"{num:g} B"


__all__ = ["format_bytes"]
