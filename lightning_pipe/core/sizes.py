"""Memory sizes as users write them: bytes, or a string with a unit (one parser for the CLI, Python and YAML).

Units follow the IEC and SI standards: ``KiB``, ``MiB``, ``GiB``, ``TiB`` are powers of 1024,
``KB``, ``MB``, ``GB``, ``TB`` powers of 1000, ``B`` (or no unit) bytes. Case is ignored and a
space may separate the number from its unit: ``"512MiB"``, ``"1.5 GB"``, ``"2gib"``, ``1e9``.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Iterable, Union

if TYPE_CHECKING:
    from torch import Tensor

Size = Union[int, float, str]

#: Bytes per unit, by the unit in upper case.
UNITS = {
    "": 1,
    "B": 1,
    **{f"{p}B": 1000 ** (i + 1) for i, p in enumerate("KMGT")},
    **{f"{p}IB": 1024 ** (i + 1) for i, p in enumerate("KMGT")},
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([KMGT]i?B|B)?\s*", flags=re.IGNORECASE)
FORMATS = "bytes as a number, or a number and a unit: B, KB/KiB, MB/MiB, GB/GiB, TB/TiB (e.g. 512MiB, 1.5GB)"


def parse_size(value: Size, name: str = "size") -> int:
    """Bytes of ``value``: a number of bytes, or a string such as ``"256MiB"`` or ``"2GB"``.

    Args:
        value: an ``int`` or ``float`` (bytes), or a string with an optional unit (see the module).
        name: the argument's name, for the error message.

    Returns:
        The size in whole bytes (fractions rounded down).

    Raises:
        ValueError: for a value that is not a size (naming ``name`` and the accepted formats), or
            one that is not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name} must be {FORMATS}; got {value!r} of type {type(value).__name__}")
    if isinstance(value, str):
        number = _number_of(value, name)
    else:
        number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a positive size ({FORMATS}); got {value!r}")
    return int(number)


def _number_of(text: str, name: str) -> float:
    """The bytes a size string names (no sign allowed: a negative size gets its own message)."""
    if text.strip().startswith("-"):
        raise ValueError(f"{name} must be a positive size ({FORMATS}); got {text!r}")
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{name} must be {FORMATS}; got {text!r}")
    mantissa, exponent, unit = match.groups()
    number = float(mantissa) * 10 ** int(exponent or 0)
    return number * UNITS[(unit or "").upper()]


def storages(tensors: Iterable[Tensor]) -> dict[int, int]:
    """Each storage under ``tensors`` once, by its address: its bytes (views and tensors that
    share a storage count it once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
