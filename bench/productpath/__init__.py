"""The parts of bench/product_path.py, one concern each (its command line and ``Run`` stay there).

plans: servers and jobs; sampling: card and host memory; prompts: the workflows queued; logs: what the Sampler's
report and the server log say; record: summaries, tables, targets and the benchmark record; integrity: the load-time
check's cost. The modules import ``scripts/`` (ComfyUI's server, the workflows) and ``bench/`` by name.
"""

import sys
from pathlib import Path

for _folder in ("scripts", "bench"):
    _path = str(Path(__file__).resolve().parents[2] / _folder)
    if _path not in sys.path:
        sys.path.insert(0, _path)
