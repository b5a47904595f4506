"""Entry point of a parallel worker process (run as a script by :mod:`.engine`, never imported by the pack).

It registers the pack under the driver's package name (so pickled plans and tensors unpickle to the same classes),
then hands over to :func:`.worker.serve`. Arguments come as one JSON object on the command line; the connection's
authentication key comes on standard input.
"""

import importlib
import importlib.util
import json
import logging
import sys
from pathlib import Path


def main() -> None:
    settings = json.loads(sys.argv[1])
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    for entry in reversed(settings["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    logging.basicConfig(level=logging.INFO, format=f"[parallel rank {settings['rank']}] %(levelname)s %(name)s: "
                        "%(message)s")
    name, root = settings["pack_name"], Path(settings["pack_root"])
    spec = importlib.util.spec_from_file_location(name, root / "__init__.py", submodule_search_locations=[str(root)])
    pack = importlib.util.module_from_spec(spec)
    sys.modules[name] = pack
    spec.loader.exec_module(pack)
    layout_module = importlib.import_module(f"{name}.qwen_edit.parallel.layout")
    worker = importlib.import_module(f"{name}.qwen_edit.parallel.worker")
    layout = layout_module.ParallelChoice(cfg=settings["cfg"], ulysses=settings["ulysses"],
                                          gpus=tuple(settings["gpus"]))
    worker.serve(settings["address"], authkey, settings["rank"], layout, settings["dist_init"], settings["device"],
                 settings["dtype"])


if __name__ == "__main__":
    main()
