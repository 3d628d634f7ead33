"""How every benchmark reports: an aligned table for people, one JSON line for tools (and,
where asked for, a plot), and a progress bar on a terminal while a long one runs."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from kvtier.extras import install_hint


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], out: TextIO) -> None:
    """Rows as an aligned text table of ``columns``; floats with 3 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}"
        return "-" if value is None else str(value)

    cells = [[cell(row.get(col)) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
    print("  ".join(col.rjust(w) for col, w in zip(columns, widths)), file=out)
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), file=out)


def print_counts(record: dict[str, Any], names: Sequence[str], out: TextIO) -> None:
    """The figures ``names`` of ``record`` as a two-column table (what, count)."""
    print_table([{"what": name, "count": record[name]} for name in names], ["what", "count"], out)


def print_json(record: dict[str, Any], out: TextIO) -> None:
    """``record`` as one JSON line (the last line a benchmark prints)."""
    print(json.dumps(record, sort_keys=True), file=out, flush=True)


def progress_bar(total: int, label: str, enabled: bool = True, unit: str = "req") -> Any:
    """A tqdm bar counting to ``total`` on stderr, shown only where stderr is a terminal (and
    ``enabled``): never on stdout, which carries the tables or the JSON line, and never in a
    log file. ``bar.update(n)`` counts; use it as a context manager."""
    from tqdm import tqdm

    # disable=None is tqdm's "off unless the stream is a TTY"
    return tqdm(total=total, desc=label, unit=unit, disable=None if enabled else True, file=sys.stderr)


def pyplot(option: str) -> Any:
    """matplotlib's pyplot on the file-only Agg backend; without matplotlib, exit naming
    ``option`` (the command-line option that asked for a plot) and the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"{option} needs matplotlib: {install_hint('plot')} ({exc})") from exc
    return plt


def save_figure(plt: Any, figure: Any, path: str, option: str, **options: Any) -> None:
    """Write ``figure`` to ``path`` and close it; a :class:`~kvtier.errors.KvtierError` naming
    ``option`` (the command-line option that gave the path) if it cannot be written there."""
    from kvtier.errors import KvtierError

    try:
        figure.savefig(path, **options)
    except OSError as exc:
        raise KvtierError(
            f"{option} {path}: the plot cannot be written there ({exc.strerror or exc}); "
            "give a path in a folder you may write"
        ) from None
    finally:
        plt.close(figure)
