"""Checks every section parser shares: choices, non-empty strings, known keys, the missing marker.

Imports nothing of kvtier but :mod:`kvtier.errors`, so any tier's section can use it.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping

from kvtier.errors import ConfigError, shown_value

__all__ = [
    "MISSING",
    "check_keys",
    "choice_fix",
    "closest",
    "join_key",
    "non_empty_str",
    "parse_choice",
    "require_mapping",
]


class _Missing:
    """Stands for a key the input lacks, so an error reads ``got <missing>``.

    ``None`` would read as if the user had written ``null``, which is a different mistake.
    """

    def __repr__(self) -> str:
        return "<missing>"


#: what a kind's :meth:`TierConfig.parse_options` passes for a required key the section lacks,
#: so that its error reads ``got <missing>`` (``section.get(key, MISSING)``)
MISSING = _Missing()


def join_key(path: str, key: object) -> str:
    text = key if isinstance(key, str) and len(key) <= 60 else shown_value(key)
    return f"{path}.{text}" if path else text


def closest(word: object, choices: tuple[str, ...] | list[str]) -> str | None:
    """The choice nearest to ``word`` ignoring case, or None if nothing is close."""
    if not isinstance(word, str):
        return None
    by_folded = {choice.lower(): choice for choice in choices}
    found = difflib.get_close_matches(word.lower(), list(by_folded), n=1, cutoff=0.6)
    return by_folded[found[0]] if found else None


def choice_fix(value: object, choices: tuple[str, ...]) -> str:
    guess = closest(value, choices)
    if guess is not None:
        return f"did you mean '{guess}'?"
    return "write one of " + ", ".join(choices)


def check_keys(section: Mapping, valid: tuple[str, ...], path: str, what: str) -> None:
    """Refuse any key outside ``valid``: a typo silently ignored is a setting silently lost."""
    for key in section:
        if isinstance(key, str) and key in valid:
            continue
        guess = closest(key, valid)
        fix = f"did you mean '{guess}'?" if guess else "remove it or use one of the keys above"
        raise ConfigError(join_key(path, key), key, f"a key of {what}: " + ", ".join(valid), fix)


def require_mapping(value: object, path: str, what: str, fix: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ConfigError(path, value, f"a mapping ({what})", fix)
    return value


def non_empty_str(value: object, field: str, expected: str, fix: str) -> str:
    """A non-blank string (an ``os.PathLike`` becomes one), or a ConfigError naming ``field``."""
    if isinstance(value, os.PathLike):
        value = os.fsdecode(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(field, value, expected, fix)
    return value


def parse_choice(value: object, field: str, choices: tuple[str, ...], bools: bool = False) -> str:
    """One of ``choices``, or a ConfigError naming ``field`` that suggests the nearest.

    ``bools``: a YAML boolean stands for on/off (YAML 1.1 reads an unquoted ``off`` as false).
    """
    if bools and isinstance(value, bool):
        return "on" if value else "off"
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(field, value, "one of " + ", ".join(choices), choice_fix(value, choices))
    return value
