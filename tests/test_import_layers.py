"""``import kvtier`` loads the library only: no tool (bench, plan, replay, soak, cli) and no
test double (kvtier.testing)."""

import json
import subprocess
import sys

TOOLS = ("kvtier.bench", "kvtier.cli", "kvtier.plan", "kvtier.replay", "kvtier.soak", "kvtier.testing")


def test_import_kvtier_loads_no_tool_code():
    code = "import json, sys, kvtier; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    loaded = json.loads(out)
    assert "kvtier" in loaded
    tools = [name for name in loaded if name in TOOLS or name.startswith(tuple(t + "." for t in TOOLS))]
    assert tools == []
