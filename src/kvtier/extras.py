"""kvtier's optional dependencies, as its error messages name them.

kvtier is installed from a wheel or a checkout, not from an index, so ``pip install
'kvtier[plot]'`` would fetch nothing. A message that needs an extra says instead how to
install the extra's own packages, with the versions ``pyproject.toml`` gives them, which
works however kvtier itself was installed: :func:`install_hint` reads them from kvtier's
installed metadata, so the words cannot drift from the pins.
"""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["extra_requirements", "install_hint"]

# 'matplotlib>=3.7; extra == "plot"': the requirement, and the extra it belongs to
_EXTRA_MARKER = re.compile(r"""^(?P<requirement>[^;]+?)\s*;\s*extra\s*==\s*["'](?P<extra>[^"']+)["']\s*$""")


def extra_requirements(extra: str) -> list[str]:
    """The requirements kvtier's ``extra`` adds (``['matplotlib>=3.7']`` for ``plot``), from
    its installed metadata; empty when kvtier is not installed or has no such extra."""
    try:
        requires = metadata.requires("kvtier") or []
    except metadata.PackageNotFoundError:
        return []
    found = []
    for line in requires:
        match = _EXTRA_MARKER.match(line)
        if match and match["extra"] == extra:
            found.append(match["requirement"].replace(" ", ""))
    return found


def install_hint(extra: str) -> str:
    """The command that installs kvtier's ``extra``, for an error message:
    ``pip install 'matplotlib>=3.7' (kvtier's plot extra)``."""
    requirements = extra_requirements(extra)
    if not requirements:  # run from a source tree that was never installed
        return f"pip install '.[{extra}]' in kvtier's checkout"
    return "pip install " + " ".join(f"'{r}'" for r in requirements) + f" (kvtier's {extra} extra)"
