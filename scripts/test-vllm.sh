#!/usr/bin/env bash
# Run kvtier's vLLM integration tests against the real vLLM 0.33 package, on a CPU-only machine.
#
# Creates (once) a virtual environment in which vLLM 0.33's kv_offload and offloading-connector
# modules import, with kvtier installed editable into it, using scripts/vllm-cpu-env.sh. Then
# runs the tests marked `vllm`, and the whole suite in the same environment (the default CI runs it without vLLM; here every vllm-marked
# test must run, none may skip).
#
# usage: scripts/test-vllm.sh [pytest args...]      (VENV=/path overrides the environment)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/kvtier-vllm-env}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm.v1.kv_offload.base" 2>/dev/null; then
  echo "== creating $VENV (CPU-only vLLM 0.33 + kvtier, a few minutes)"
  scripts/vllm-cpu-env.sh "$VENV" -e '.[test]'
fi
# An environment made by hand (or by the tool without '.[test]') may lack the test tools or this
# checkout; both installs are no-ops when already satisfied.
"$VENV/bin/python" -c "import pytest, hypothesis" 2>/dev/null || "$VENV/bin/pip" install -q pytest hypothesis
# An environment made before kvtier gained a dependency lacks it: installing with the dependencies
# adds what is missing and leaves the engine's own pins (torch included) as they are.
"$VENV/bin/python" scripts/env-has-kvtier.py || "$VENV/bin/pip" install -q -e .

echo "== vllm-marked tests ($("$VENV/bin/python" -c 'import vllm; print("vLLM", vllm.__version__)'))"
# -rs lists skips; a skip here means the environment is broken, so it fails the run.
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$VENV/bin/python" -m pytest -m vllm tests/integrations -q -rs "$@" | tee "$out"
if grep -qE "^SKIPPED|[0-9]+ skipped" "$out"; then
  echo "error: vllm-marked tests were skipped in $VENV; vLLM does not import there" >&2
  exit 1
fi

echo "== the whole suite in the same environment"
"$VENV/bin/python" -m pytest -q "$@"
