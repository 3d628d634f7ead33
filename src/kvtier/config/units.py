"""Sizes and counts: parse ``64GiB`` into bytes, format bytes for people, bound whole numbers.

Imports nothing of kvtier but :mod:`kvtier.errors` and :mod:`~kvtier.config.checks`: the
shared-memory region uses it too.
"""

from __future__ import annotations

import operator
import re
from decimal import Decimal, InvalidOperation, localcontext

from kvtier.config.checks import closest
from kvtier.errors import ConfigError

__all__ = [
    "MAX_FIELD_INT",
    "MAX_SIZE_TEXT",
    "MiB",
    "SIZE_FORMS",
    "describe_size",
    "format_size",
    "parse_size",
    "positive_int",
    "positive_size",
]

MiB = 1 << 20

# Keyed by the lower-cased unit so that `gib` and `GIB` work; the lower-cased forms of binary
# and decimal units never collide, so folding case loses nothing.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
# Bare prefixes are refused rather than guessed: `64G` means 64 * 10^9 to some tools and
# 64 * 2^30 to others, and a 7% error in a capacity goes unnoticed.
_AMBIGUOUS_UNITS = {"k": ("KiB", "kB"), "m": ("MiB", "MB"), "g": ("GiB", "GB"), "t": ("TiB", "TB")}
# Kubernetes' `Gi` is not ambiguous, but one spelling per unit keeps configs greppable.
_KUBERNETES_UNITS = {"ki": "KiB", "mi": "MiB", "gi": "GiB", "ti": "TiB"}
_CANONICAL_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "kB", "MB", "GB", "TB")
SIZE_FORMS = (
    "a whole number of bytes: an int >= 0, or a string such as '4096', '4096B', '512MiB', "
    "'64GiB', '1.5TB' (binary KiB MiB GiB TiB = 1024^n, decimal kB MB GB TB = 1000^n)"
)
_SIZE_RE = re.compile(r"\s*([+-]?)\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
#: the largest size or count a field takes: what a signed 64-bit offset holds (8 EiB). A
#: bigger one is a typo, and past it sizes overflow the C calls and formats below.
MAX_FIELD_INT = 2**63 - 1
#: the longest size text parse_size reads: '9223372036854775807' and a unit fit with room
MAX_SIZE_TEXT = 64
# format_size stops at TiB because parse_size accepts nothing larger: an exact size's text
# must parse back.
_FORMAT_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def parse_size(value: object, field: str) -> int:
    """Return ``value`` as a whole number of bytes, or raise ConfigError naming ``field``.

    Accepts an int >= 0, a whole float, or a string of a number and an optional unit
    (``4096``, ``4096B``, ``2 KiB``, ``512MiB``, ``1.5TB``). Binary units are 1024^n and
    decimal units 1000^n; units fold case only where that stays unambiguous, so ``gib`` is
    GiB and ``gb`` is GB, while a bare ``G`` is refused.
    """
    # bool is an int subclass, and `capacity: yes` is a typo, never a size of 1 byte
    if isinstance(value, bool):
        raise ConfigError(field, value, SIZE_FORMS, "write a size such as 64GiB")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(field, value, SIZE_FORMS, "sizes cannot be negative")
        return _bounded(value, value, field)
    if isinstance(value, float):
        # Decimal(float) is exact, so 1024.0 passes and 1.5 is caught as a fraction of a byte
        return _whole_bytes(Decimal(value), value, field)
    if not isinstance(value, str):
        raise ConfigError(field, value, SIZE_FORMS, "write a size such as 64GiB")
    if len(value) > MAX_SIZE_TEXT:  # before the regex and Decimal see thousands of digits
        raise ConfigError(
            field, value, SIZE_FORMS + f", at most {MAX_SIZE_TEXT} characters", "write a size such as 64GiB"
        )

    match = _SIZE_RE.fullmatch(value)
    if match is None:
        raise ConfigError(field, value, SIZE_FORMS, "write a size such as 64GiB or 4096")
    sign, number, unit = match.groups()
    if sign == "-":
        raise ConfigError(field, value, SIZE_FORMS, "sizes cannot be negative")
    folded = unit.lower()
    if folded in _AMBIGUOUS_UNITS:
        binary, decimal = _AMBIGUOUS_UNITS[folded]
        raise ConfigError(
            field,
            value,
            SIZE_FORMS,
            f"'{unit}' is ambiguous: write {number}{binary} (binary) or {number}{decimal} (decimal)",
        )
    if folded in _KUBERNETES_UNITS:
        raise ConfigError(field, value, SIZE_FORMS, f"write {number}{_KUBERNETES_UNITS[folded]}")
    if folded not in _SIZE_UNITS:
        guess = closest(unit, _CANONICAL_UNITS)
        hint = f"did you mean {number}{guess}?" if guess else "use one of " + ", ".join(_CANONICAL_UNITS)
        raise ConfigError(field, value, SIZE_FORMS, f"unknown unit '{unit}'; {hint}")
    # Enough digits that the product is exact: a rounded product could pass a fraction of a
    # byte off as a whole one.
    with localcontext() as context:
        context.prec = len(number) + 16
        amount = Decimal(number) * _SIZE_UNITS[folded]
    return _whole_bytes(amount, value, field)


def _whole_bytes(amount: Decimal, value: object, field: str) -> int:
    try:
        whole = amount.is_finite() and amount == amount.to_integral_value()
    except InvalidOperation:  # a signalling NaN
        whole = False
    if not whole:
        raise ConfigError(field, value, SIZE_FORMS, "the size must come to a whole number of bytes")
    if amount < 0:
        raise ConfigError(field, value, SIZE_FORMS, "sizes cannot be negative")
    return _bounded(int(amount), value, field)


def _bounded(number: int, value: object, field: str) -> int:
    if number > MAX_FIELD_INT:
        raise ConfigError(field, value, f"at most {MAX_FIELD_INT} (8 EiB)", "check the number of digits")
    return number


def format_size(n: int) -> str:
    """Render ``n`` bytes for people, in binary units: ``64 GiB``, ``1.5 MiB``, ``512 B``.

    Shows at most two decimals, so the result may be rounded; ``describe`` adds the exact
    byte count where it is.
    """
    return _format_size(n)[0]


def _format_size(n: int) -> tuple[str, bool]:
    """format_size's text, and whether that text is exactly ``n`` bytes."""
    # A programming mistake, not user input: callers format sizes they already validated.
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"format_size takes an int number of bytes, got {n!r}")
    if n < 0:
        raise ValueError(f"format_size takes a number of bytes >= 0, got {n}")
    for index, (unit, size) in enumerate(_FORMAT_UNITS):
        if n < size:
            continue
        # enough digits for any n: the default 28 made quantize fail past 10^26 bytes
        with localcontext() as context:
            context.prec = len(str(n)) + 4
            shown = (Decimal(n) / size).quantize(Decimal("0.01"))
            # 1048575 B rounds to 1024.00 KiB; one unit up reads better and is as close
            if shown >= 1024 and index > 0:
                unit, size = _FORMAT_UNITS[index - 1]
                shown = (Decimal(n) / size).quantize(Decimal("0.01"))
            text = f"{shown:f}".rstrip("0").rstrip(".")
            return f"{text} {unit}", shown * size == n
    return f"{n} B", True


def positive_int(value: object, field: str) -> int:
    """``value`` as an int >= 1 (numpy integers too), or a ConfigError naming ``field``."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]  # refuses floats and strings
    except TypeError:
        number = 0
    if isinstance(value, bool) or number < 1:
        raise ConfigError(field, value, "an integer >= 1", "write a whole number such as 256")
    return _bounded(number, value, field)


def positive_size(value: object, field: str) -> int:
    """A size > 0 in bytes (see :func:`parse_size`), or a ConfigError naming ``field``."""
    size = parse_size(value, field)
    if size == 0:
        raise ConfigError(field, value, "a size > 0", "write a size such as 512MiB")
    return size


def describe_size(n: int) -> str:
    """format_size, plus the exact count where the human form had to round."""
    shown, exact = _format_size(n)
    return shown if exact else f"{shown} ({n} B)"
