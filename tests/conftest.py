import sys
from pathlib import Path

# The helpers next to the tests (plugin_dists, ...) import by plain name.
sys.path.insert(0, str(Path(__file__).parent))
