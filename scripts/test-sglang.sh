#!/usr/bin/env bash
# Run kvtier's SGLang integration tests against the real SGLang 0.5.23 package, on a CPU-only
# machine.
#
# Creates (once) a virtual environment in which SGLang's HiCache storage and host pool modules
# import, with kvtier installed editable into it, using scripts/sglang-cpu-env.sh. Then runs
# the tests marked `sglang` (a skip there means the environment is broken, so it fails the run)
# and the SGLang integration's other tests in the same environment.
#
# usage: scripts/test-sglang.sh [pytest args...]      (VENV=/path overrides the environment)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/kvtier-sglang-env}

if [ ! -x "$VENV/bin/python" ] || ! (cd /tmp && "$VENV/bin/python" -W ignore -c "import sglang.srt.mem_cache.storage.backend_factory") 2>/dev/null; then
  echo "== creating $VENV (CPU-only SGLang 0.5.23 + kvtier, a few minutes)"
  bash scripts/sglang-cpu-env.sh "$VENV" -e '.[test]'
fi
# An environment made by hand may lack this checkout; the install is a no-op when it has it.
# An environment made before kvtier gained a dependency lacks it: installing with the dependencies
# adds what is missing and leaves the engine's own pins (torch included) as they are.
"$VENV/bin/python" scripts/env-has-kvtier.py || "$VENV/bin/pip" install -q -e .

echo "== sglang-marked tests ($("$VENV/bin/python" -W ignore -c 'import sglang; print("SGLang", sglang.__version__)' 2>/dev/null))"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$VENV/bin/python" -m pytest -m sglang tests/integrations/test_sglang_backend.py tests/integrations/test_quickstarts.py -q -rs -p no:cacheprovider "$@" | tee "$out"
if grep -qE "^SKIPPED|[0-9]+ skipped" "$out"; then
  echo "error: sglang-marked tests were skipped in $VENV; SGLang does not import there" >&2
  exit 1
fi
echo "== the SGLang integration's other tests in the same environment"
"$VENV/bin/python" -m pytest tests/integrations/test_sglang_settings.py tests/integrations/test_no_vllm_import.py -q -p no:cacheprovider "$@"
