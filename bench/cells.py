"""How the benchmarks' markdown tables write a figure, and what they write where there is none."""

from __future__ import annotations

NONE = "—"


def number(value: float | None, digits: int) -> str:
    """With thousands separators: 1,234.5."""
    return NONE if value is None else f"{value:,.{digits}f}"


def times(value: float | None, digits: int = 3) -> str:
    """A ratio: 1.234x."""
    return NONE if value is None else f"{value:.{digits}f}x"


def percent(value: float | None) -> str:
    """A signed change: +1.2%."""
    return NONE if value is None else f"{value:+.1f}%"
