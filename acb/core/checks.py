"""Type checks the configs' validation shares: JSON and Python both let a bool pass for an
int (``True == 1``), and no count, seed or bound of acb's may be one."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float that is not a bool (finite or not: the callers say)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
