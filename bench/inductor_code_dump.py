#!/usr/bin/env python3
"""Run the fastest preset's compiled forward once per batch size so that Inductor's generated code can be read.

Full-size DiT, random weights, the 1024x1024 edit with one reference image; one batch-1 and one batch-2 forward
(``cudnn_fp8`` attention). Run it with ``TORCH_LOGS=output_code`` to get the wrapper code of every compiled graph,
including the launches of the pack's own Triton kernels (``torch.library.triton_op``) with the ``triton_meta``
Inductor gives them: which arguments it tells Triton are multiples of 16 (``tt.divisibility``). From the repository
root on an H100 / H200::

    TORCH_LOGS=output_code python3 bench/inductor_code_dump.py 2> $OUT/output_code.log
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_models as hm
from pack import load_pack


def main() -> int:
    load_pack()
    from qwen_edit_hopper.qwen_edit import fast_forward as ff
    from qwen_edit_hopper.qwen_edit.compile import dynamo_settings

    module, inputs = hm.fastest_fp8_dit_at_full_size(torch.device("cuda"))
    with dynamo_settings():
        for batch in (1, 2):
            out = hm.fast_forward(ff, module, inputs, batch=batch, attention="cudnn_fp8")
            print(f"batch {batch}: output {tuple(out.shape)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
