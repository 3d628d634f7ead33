#!/usr/bin/env bash
# The install a user makes, checked the way a user meets it: kvtier built into a wheel,
# installed into a fresh virtual environment outside the checkout, then run from a folder that
# is not the checkout, so that nothing of src/ can stand in for what the wheel forgot (the
# bundled traces, a module left out of the package). CI runs it after scripts/check.sh.
#
#   scripts/check-wheel.sh        (PYTHON=... builds with another Python; KEEP=1 keeps the folder)
#
# The wheel is built from a copy of the files git knows (tracked, or new and not ignored), as
# a fresh clone has them: setuptools leaves a build/ folder beside what it builds, and a stale
# one could put deleted modules into the wheel. `pip wheel --no-deps` needs no `build` package
# (pip already runs the build backend for the editable install). torch==2.13.0 is installed
# first (on a CPU-only machine pip then takes the CPU build already on disk), then the wheel
# with its prometheus extra, in the form the docs give for an extra.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
work=$(mktemp -d)
if [ "${KEEP:-0}" != 1 ]; then trap 'rm -rf "$work"' EXIT; fi
echo "== wheel: build from the files git knows, in $work" >&2
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - | tar -xf - -C "$work/src"
"$PYTHON" -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/kvtier-*.whl)
echo "== wheel: install $(basename "$wheel") into a fresh venv" >&2
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q torch==2.13.0 "$wheel[prometheus]"
cd "$work"
"$work/venv/bin/python" - <<'PY'
import os, sys, kvtier
site = os.path.realpath(os.path.join(sys.prefix, "lib"))
assert os.path.realpath(kvtier.__file__).startswith(site), f"kvtier is not the installed one: {kvtier.__file__}"
print(f"kvtier {kvtier.__version__} from {os.path.dirname(kvtier.__file__)}", file=sys.stderr)
# where a C compiler is, the wheel carries the hot path in C (else kvtier runs it in Python)
import shutil
if shutil.which(os.environ.get("CC", "cc")):
    import kvtier._speedups
    print(f"kvtier._speedups built: {kvtier._speedups.__file__}", file=sys.stderr)
PY
echo "== wheel: kvtier --version, then a short replay of each bundled trace" >&2
"$work/venv/bin/kvtier" --version
"$work/venv/bin/kvtier" replay --limit 300 --no-progress
"$work/venv/bin/kvtier" replay conversation --limit 300 --no-progress --no-baseline
