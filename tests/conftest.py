import sys
from pathlib import Path

# Tests import their helpers as a plain module, whatever the rootdir.
sys.path.insert(0, str(Path(__file__).parent))
