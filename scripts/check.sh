#!/usr/bin/env bash
# What CI runs after the install (.ci/run), and the README's second command: the linter, the
# type checker, the docs build, then the test suite, stopping at the first that fails.
#
#   scripts/check.sh [pytest arguments...]
#
# The suite runs in parallel, one pytest-xdist worker per core (-n auto); tests that share a
# fixed resource say so with @pytest.mark.xdist_group, which --dist loadgroup keeps on one
# worker. `scripts/check.sh -n 0` runs it serially; `-m "not slow"` leaves out the slow tests.
#
# Uses .venv/bin/python where there is one, else python3 (PYTHON=... overrides); that Python
# needs the '.[test]' extra (ruff, mypy, mkdocs, pytest and the test dependencies). The settings
# of ruff, mypy and pytest live in pyproject.toml, the docs' in mkdocs.yml. Where mkdocs is not
# installed the docs build is skipped with a note, unless KVTIER_REQUIRE_DOCS=1 (CI sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
echo "== ruff check" >&2
"$PYTHON" -m ruff check src tests benchmarks
echo "== ruff format --check" >&2
"$PYTHON" -m ruff format --check src tests benchmarks examples docs/gen_config.py docs/gen_metrics.py docs/gen_tables.py
echo "== mypy" >&2
"$PYTHON" -m mypy
echo "== mkdocs build --strict" >&2
if "$PYTHON" -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
    site=$(mktemp -d)
    trap 'rm -rf "$site"' EXIT
    NO_MKDOCS_2_WARNING=1 "$PYTHON" -m mkdocs build --strict --quiet --site-dir "$site"
elif [ "${KVTIER_REQUIRE_DOCS:-0}" = 1 ]; then
    echo "mkdocs, mkdocs-material or mkdocstrings[python] is missing: pip install -e '.[docs]'" >&2
    exit 1
else
    echo "skipped: mkdocs is not installed here (pip install -e '.[docs]')" >&2
fi
echo "== pytest" >&2
if "$PYTHON" -c "import xdist" 2>/dev/null; then
    "$PYTHON" -m pytest -n auto --dist loadgroup "$@"
else  # a venv made before pytest-xdist joined the test extra
    echo "pytest-xdist is not installed (pip install -e '.[test]'): running serially" >&2
    "$PYTHON" -m pytest "$@"
fi
