"""Integer arithmetic the engine needs in many places, written once."""

from __future__ import annotations


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division: how many blocks of `denominator` slots hold `numerator` tokens."""
    return -(-numerator // denominator)
