"""Card memory a DiT build leaves behind under cudaMallocAsync, per way of reading the file (one process each).

The staged reader's build left about 3.5 GiB more on the card than safetensors' own reader, with the same tensors
allocated. Each variant builds the full-size fp8 DiT of the fastest preset in a fresh process with ComfyUI's
default allocator and prints the card's used memory after the build and after ``torch.cuda.empty_cache()``:

* ``staged``: the product's reader (threads, page-locked staging, the next group read ahead, each group's copies to
  the device waited for before the caller gets it);
* ``staged-async``: the same with the copies left in flight (the caller's work queued behind them);
* ``staged-no-prefetch``: the same reader, one group at a time (no read-ahead);
* ``staged-pageable``: read-ahead into plain host memory (no ``cudaHostRegister``);
* ``staged-1-thread``: one reader thread;
* ``staged-torch-pinned``: staging from PyTorch's pinned-memory allocator instead of ``cudaHostRegister``;
* ``safetensors``: ``load_tensors`` per group.

Run on the GPU machine: ``python3 bench/card_memory_probe.py MODELS_DIR``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VARIANTS = ("staged", "staged-async", "staged-1-thread", "staged-torch-pinned", "staged-pageable", "safetensors")


def one(models: Path, variant: str) -> None:
    import gc

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import load_bench as lb
    from qwen_edit_hopper.fp8 import Fp8Config
    from qwen_edit_hopper.qwen_edit.checkpoints import resolve_single_files, staged_read
    from qwen_edit_hopper.qwen_edit.dit_build import DitSource, build_dit

    files = resolve_single_files(models / lb.FOLDERS["dit"] / lb.DIT_FILES["fp8"],
                                 models / lb.FOLDERS["text_encoder"] / lb.TEXT_ENCODER_FILE,
                                 models / lb.FOLDERS["vae"] / lb.VAE_FILE)
    source = DitSource(files)
    if variant == "safetensors":
        source = lb._SafetensorsGroups(source)
    elif variant == "staged-no-prefetch":
        whole = staged_read.read_groups

        def one_at_a_time(groups, **kwargs):
            for spans in groups:
                yield from whole([spans], **kwargs)

        staged_read.read_groups = one_at_a_time
        sys.modules["qwen_edit_hopper.qwen_edit.dit_build"].read_groups = one_at_a_time
    elif variant == "staged-pageable":
        real = staged_read._Staging.__init__

        def pageable(self, nbytes, device):
            real(self, nbytes, torch.device("cpu"))
            self.device = device

        staged_read._Staging.__init__ = pageable
    elif variant == "staged-async":
        synchronize = torch.cuda.Stream.synchronize
        torch.cuda.Stream.synchronize = lambda self: None  # the reader's wait after its copies (nothing else here)
        staged_read._Staging.release = lambda self, real=staged_read._Staging.release: (synchronize(
            torch.cuda.current_stream()), real(self))[1]
    elif variant == "staged-1-thread":
        staged_read.READER_THREADS = 1
        whole = staged_read.read_groups

        def one_thread(groups, **kwargs):
            return whole(groups, threads=1, **kwargs)

        sys.modules["qwen_edit_hopper.qwen_edit.dit_build"].read_groups = one_thread
    elif variant == "staged-torch-pinned":
        def torch_pinned(self, nbytes, device):
            self.device, self.arena, self.done = device, None, None
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
            self.view = memoryview(self.buffer.numpy())

        staged_read._Staging.__init__ = torch_pinned
    config = Fp8Config(backend="scaled_mm_rowwise", preset=lb.FASTEST_PRESET, gemm_kernel=lb.FASTEST_GEMM_KERNEL)
    model = build_dit(source, device="cuda", fp8_config=config).module
    torch.cuda.synchronize()
    after = lb._card_used_gib(torch.device("cuda"))
    gc.collect()
    torch.cuda.empty_cache()
    trimmed = lb._card_used_gib(torch.device("cuda"))
    print(f"| {variant} | {torch.cuda.get_allocator_backend()} | {after} | {trimmed} | "
          f"{torch.cuda.memory_allocated() / 2**30:.2f} |", flush=True)
    del model


def main() -> int:
    models = Path(sys.argv[1])
    if len(sys.argv) > 2:
        one(models, sys.argv[2])
        return 0
    print("| reader | allocator | card GiB after build | after empty_cache | torch allocated GiB |\n"
          "|---|---|---|---|---|", flush=True)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    for variant in VARIANTS:
        subprocess.run([sys.executable, __file__, str(models), variant], env=env, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
