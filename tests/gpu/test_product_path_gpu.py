"""Memory and reliability of the product path on a real GPU, with the tiny checkpoints.

* the text encoder streamed from page-locked host memory encodes exactly like one held on the GPU, and holds only
  its small resident part on the GPU between uses;
* the DiT built group by group on the GPU equals the fp8 conversion of the whole-file model;
* that build (each block packed into one allocation) captured in CUDA graphs computes what its kernel-by-kernel
  forwards do, replays with new inputs, and reads a weight changed in place inside that allocation (as a LoRA
  fuse writes);
* under PyTorch's cudaMallocAsync allocator (ComfyUI's default where the driver supports it) CUDA graphs are not
  used, the reason is reported, and compiled forwards run;
* a build that fails half-way leaves no GPU memory behind;
* the DiT built on a worker thread while the prompt is encoded gives the image a DiT built beforehand gives, and
  an interrupt after the encoding drops it.

Run on the device machine (ComfyUI's source for the tokenizer files: ``QWEN_EDIT_COMFYUI_DIR``)::

    python3 -m pytest tests/gpu/test_product_path_gpu.py -m gpu -q -rs
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_edit_hopper.fp8 import Fp8Config
from qwen_edit_hopper.qwen_edit.checkpoints import load_dit, load_text_encoder, resolve_single_files
from qwen_edit_hopper.qwen_edit.dit_build import DitSource, build_dit
from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit
from qwen_edit_hopper.qwen_edit.plan import Variant
from qwen_edit_hopper.qwen_edit.runtime import text_encoder_units
from qwen_edit_hopper.qwen_edit.sampling import _PipeShell, encode_prompt
from qwen_edit_hopper.qwen_edit.streaming import stream_layers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_checkpoints_support import COMFY_TOKENIZER_DIR, tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
FASTEST = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", fast_accum=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    written = tiny("comfy_single", "edit_2509", tmp_path_factory)
    return resolve_single_files(written["dit_fp8"], written["text_encoder_fp8"], written["vae"][0])


def _encode(text_encoder, files) -> torch.Tensor:
    from qwen_edit_hopper.qwen_edit.checkpoints import load_processor

    processor = load_processor(files, comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
    shell = _PipeShell(torch.device("cuda"), torch.bfloat16, text_encoder=text_encoder, processor=processor)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    with torch.no_grad():
        return encode_prompt(shell, "make the sky red", [image], Variant.EDIT_2509)["prompt_emb"]


def test_streamed_text_encoder_encodes_exactly_and_holds_little_on_the_gpu(files):
    resident = load_text_encoder(files, device="cuda")
    expected = _encode(resident, files)
    del resident
    torch.cuda.empty_cache()

    before = torch.cuda.memory_allocated()
    streamed = load_text_encoder(files, device="cpu")
    streaming = stream_layers(streamed, text_encoder_units(streamed), "cuda")
    held = torch.cuda.memory_allocated() - before
    assert held == streaming.device_bytes or held <= streaming.device_bytes + 2**20
    assert streaming.host_bytes > 5 * streaming.device_bytes  # the embedding and the layers live on the host
    got = _encode(streamed, files)
    torch.cuda.synchronize()
    assert torch.equal(got, expected)
    assert torch.cuda.memory_allocated() - before - got.numel() * got.element_size() <= held + 2**20
    streaming.remove()


def test_dit_built_on_the_gpu_equals_the_whole_file_conversion(files):
    built = build_dit(DitSource(files), device="cuda", dtype=torch.bfloat16, fp8_config=FASTEST).module
    reference = build_fp8_dit(load_dit(files, device="cuda", dtype=torch.bfloat16), FASTEST)
    a, b = built.state_dict(), reference.state_dict()
    assert set(a) == set(b)
    for key in a:
        x, y = a[key], b[key]
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), key


def test_cuda_graphs_on_the_packed_build_match_kernel_by_kernel(files):
    if torch.cuda.get_allocator_backend() != "native":
        pytest.skip("CUDA graphs need PyTorch's native caching allocator")
    from qwen_edit_hopper.qwen_edit.compile import warmup_inputs
    from qwen_edit_hopper.qwen_edit.fast.prepared import PreparedDit
    from qwen_edit_hopper.qwen_edit.fast_forward import fast_model_fn

    dit = build_dit(DitSource(files), device="cuda", dtype=torch.bfloat16, fp8_config=FASTEST).module
    block = dit.transformer_blocks[0]
    storages = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers()] if t.is_cuda}
    assert len(storages) == 1  # the packed build: the block's tensors are views of one allocation
    prepared = PreparedDit(dit)
    first = warmup_inputs(dit, 128, 128, device="cuda")
    second = {**first, "latents": torch.randn_like(first["latents"])}
    with torch.no_grad():
        plain = [fast_model_fn(prepared, **x, attention_backend="sdpa") for x in (first, second)]
        state = prepared.enable_cuda_graphs()
        try:
            graphed = [fast_model_fn(prepared, **x, attention_backend="sdpa") for x in (first, second)]
            assert state.captures == 1 and state.replays == 2, (state.captures, state.replays)
            for g, p in zip(graphed, plain, strict=True):
                assert (g.float() - p.float()).norm() <= 1e-3 * p.float().norm()
            assert not torch.equal(graphed[0], graphed[1])  # the new latents went into the graph
            # a weight changed in place inside the packed allocation (as a LoRA fuse writes): the graph reads it
            codes = block.img_mlp.net[2].weight.data.view(torch.uint8)  # fp8 or bf16: zero bytes are zeros
            saved = codes.clone()
            codes.zero_()
            try:
                changed = fast_model_fn(prepared, **first, attention_backend="sdpa")
                prepared.disable_cuda_graphs()
                eager = fast_model_fn(prepared, **first, attention_backend="sdpa")
                assert (changed.float() - eager.float()).norm() <= 1e-3 * eager.float().norm()
                assert not torch.equal(changed, graphed[0])
            finally:
                codes.copy_(saved)
        finally:
            prepared.disable_cuda_graphs()


def test_a_failed_build_leaves_no_gpu_memory(files):
    from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime, released_on_failure

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise InterruptedError("stop")

    runtime = PlanRuntime("cuda")
    with pytest.raises(InterruptedError), released_on_failure(runtime.device):
        build_dit(DitSource(files), device="cuda", dtype=torch.bfloat16, fp8_config=FASTEST, check_interrupt=interrupt)
    assert torch.cuda.memory_allocated() == before


CUDA_MALLOC_ASYNC_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {scripts!r}); sys.path.insert(0, {unit!r})
    from pack import load_pack
    load_pack()
    from qwen_edit_hopper.fp8 import Fp8Config
    from qwen_edit_hopper.qwen_edit.checkpoints import resolve_single_files
    from qwen_edit_hopper.qwen_edit.compile import compiled_forward_context, set_regional_compile, warmup_inputs
    from qwen_edit_hopper.qwen_edit.dit_build import DitSource, build_dit
    from qwen_edit_hopper.qwen_edit.fast_forward import PreparedDit, fast_model_fn
    from qwen_edit_hopper.qwen_edit.memory import Resident
    from qwen_edit_hopper.qwen_edit.plan import CompileChoice
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync", torch.cuda.get_allocator_backend()
    files = resolve_single_files({dit!r}, {te!r}, {vae!r})
    config = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", fast_accum=True)
    dit = build_dit(DitSource(files), device="cuda", fp8_config=config).module
    resident = Resident(key=("t",), module=dit, nbytes=0, label="t", prepared=PreparedDit(dit))
    choice = CompileChoice(cuda_graphs=True)
    set_regional_compile(resident, choice)
    assert resident.extra["cuda_graphs"].startswith("off: PyTorch's CUDA allocator here is cudaMallocAsync")
    assert resident.prepared.graphs is None
    inputs = warmup_inputs(dit, 128, 128, device="cuda")
    with compiled_forward_context(choice), torch.no_grad():
        for _ in range(2):
            out = fast_model_fn(dit=resident.prepared, attention_backend="sdpa", **inputs)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    print("ok", resident.extra["cuda_graphs"])
""")


def test_cuda_graphs_are_not_used_under_cuda_malloc_async_and_forwards_run(files):
    script = CUDA_MALLOC_ASYNC_SCRIPT.format(scripts=str(ROOT / "scripts"), unit=str(ROOT / "tests" / "unit"),
                                             dit=str(files.dit[0]), te=str(files.text_encoder[0]),
                                             vae=str(files.vae[0]))
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "ok off: PyTorch's CUDA allocator here is cudaMallocAsync" in done.stdout


@pytest.mark.parametrize("compiled", [False, True])
def test_blocks_streamed_from_host_memory_give_the_same_output_and_hold_less(files, compiled):
    """The low VRAM workflow's host_blocks: the last blocks live in page-locked host memory and visit the GPU for
    each forward; the output is the same bit for bit, the GPU holds about their bytes less (also at the build's
    peak: a host block leaves the GPU as soon as it is built), CUDA graphs are off."""
    from qwen_edit_hopper.qwen_edit.compile import compiled_forward_context, set_regional_compile, warmup_inputs
    from qwen_edit_hopper.qwen_edit.fast.prepared import PreparedDit
    from qwen_edit_hopper.qwen_edit.fast_forward import fast_model_fn
    from qwen_edit_hopper.qwen_edit.memory import Resident
    from qwen_edit_hopper.qwen_edit.plan import CompileChoice

    config = Fp8Config(backend="weight_only")
    choice = CompileChoice(cuda_graphs=True) if compiled else None
    outputs, held, build_peak = [], [], []
    for streamed in (0, 2):  # both of the tiny DiT's blocks: one built while the other is already on the host
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        dit = build_dit(DitSource(files), device="cuda", dtype=torch.bfloat16, fp8_config=config,
                        host_blocks=streamed).module
        held.append(torch.cuda.memory_allocated() - before)
        build_peak.append(torch.cuda.max_memory_allocated() - before)
        resident = Resident(key=("t", streamed), module=dit, nbytes=0, label="t",
                            prepared=PreparedDit(dit, getattr(dit, "layer_streaming", None)))
        set_regional_compile(resident, choice)
        if compiled and streamed:
            assert resident.extra["cuda_graphs"].startswith("off: 2 blocks are streamed from host memory")
        inputs = warmup_inputs(dit, 128, 128, device="cuda")
        with compiled_forward_context(choice), torch.no_grad():
            for _ in range(2):
                out = fast_model_fn(dit=resident.prepared, attention_backend="sdpa", **inputs)
        torch.cuda.synchronize()
        outputs.append(out.clone())
        del dit, resident, out
    assert torch.equal(outputs[0], outputs[1])
    assert held[1] < held[0]
    assert build_peak[1] < build_peak[0]


def _edit_request():
    from qwen_edit_hopper.qwen_edit.sampling import EditRequest

    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8))
    return EditRequest(images=(image,), prompt="make it blue", negative_prompt=" ", seed=3, steps=2, cfg=4.0,
                       width=64, height=48, reference_pixels=64 * 48)


def test_the_dit_built_beside_the_encoding_gives_the_same_image_and_an_interrupt_drops_it(files):
    from qwen_edit_hopper.qwen_edit.edit import run_edit
    from qwen_edit_hopper.qwen_edit.plan import PipePlan
    from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime
    from qwen_edit_hopper.qwen_edit.sampling import Callbacks

    plan = PipePlan(files=files, variant=Variant.EDIT_2509, variant_reason="test").with_fp8(FASTEST)
    request = _edit_request()
    with torch.inference_mode():
        built_first = PlanRuntime("cuda", comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
        dit_bytes = built_first.dit(plan).nbytes  # built on this thread, before the edit
        expected, timings = run_edit(built_first, plan, request)
        assert "dit_waited_s" not in timings.extra
        built_first.evict_all()

        runtime = PlanRuntime("cuda", comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
        runtime.text_encoder(plan)
        runtime.vae(plan)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()

        def interrupted():
            raise InterruptedError("interrupted by the user")

        with pytest.raises(InterruptedError):
            run_edit(runtime, plan, request, Callbacks(check_interrupt=interrupted))
        runtime.conditioning.clear()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before < dit_bytes / 2  # the cancelled build's DiT is gone
        assert [resident.key[0] for resident in runtime.residents()] == ["text_encoder", "vae"]

        image, timings = run_edit(runtime, plan, request)
    assert timings.extra["dit_waited_s"] >= 0
    assert torch.equal(image, expected)
