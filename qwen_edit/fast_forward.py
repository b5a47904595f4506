"""A fast, batched Qwen-Image(-Edit) DiT forward: the function of DiffSynth's ``model_fn_qwen_image``.

``fast_model_fn`` takes the arguments DiffSynth's ``model_fn_qwen_image`` takes (the ones the
sampler passes) and returns the same latents, for batch 1 and for batch B >= 2 (true CFG: cond and
uncond in one forward, prompts of different lengths right-padded; see :func:`batch_prompts`)::

    from .fast_forward import PreparedDit, batch_prompts, fast_model_fn, fuse_qkv

    fuse_qkv(dit)                                   # optional, in place, before fp8 quantization
    prepared = PreparedDit(dit)                     # what the forward keeps for this model
    prepared.compile_blocks()                       # optional, regional compile of the block function
    text = batch_prompts([positive, negative])      # (2, L, T) + mask + host-side lengths
    pred = fast_model_fn(dit=prepared, latents=lat.expand(2, -1, -1, -1), timestep=t, height=h, width=w,
                         edit_latents=refs, zero_cond_t=False, attention_backend="sdpa", **text)
    pos, neg = pred.chunk(2)

The fused kernels it may use come from a :class:`~.fast.options.ForwardOptions` value (``options``, default
:data:`~.fast.options.SHIPPED`); :func:`~.fast.kernel_plan.select_kernels` decides per model, shape, device and
backend which of them run and reports the others with their reasons (:func:`kernel_plan`).

What differs from DiffSynth (none of it changes the function; tests/unit/test_fast_forward*.py):

* the joint attention sequence is ``[image, text]`` (DiffSynth: ``[text, image]``; unmasked attention
  does not depend on token order);
* RoPE from cached real cos/sin tables, fused with the QK RMSNorm (:mod:`.fast.rope`, :mod:`.fast.block`);
* no host syncs per call: RoPE tables and zero_cond_t's token selector are kept per shape, text lengths per mask
  tensor (or given as ``txt_seq_lens``);
* with fp8 modulation weights on a GPU (kernel ``shared_modulation``), all blocks' ``img_mod`` / ``txt_mod``
  linears run before the first block in two launches (:mod:`.fast.modulation`);
* ``norm_out`` / ``proj_out`` run on the target image tokens only (DiffSynth computes all, then slices), and
  so does the last block after its attention (``trim_last_block``): its output projection and MLP for the
  reference tokens, its attention's other query rows (cuDNN FP8 attention) and its text stream after the attention
  are not computed;
* the final unpatchify keeps the batch (DiffSynth's fixes B = 1).

Not supported (raises NotImplementedError): entity prompts, blockwise ControlNet, layered models
(``layer_num``, ``layer_input_latents``, ``context_latents``), KV cache, DiffSynth's FA3 fp8
attention flag (use ``attention_backend="triton_fp8"``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812

from .fast.block import MASK_BACKENDS, fast_block, length_carriers
from .fast.compile import mark_sequence_dynamic
from .fast.kernel_plan import ForwardShape, KernelPlan
from .fast.modulation import block_modulations
from .fast.options import SHIPPED, ForwardOptions
from .fast.prepared import PreparedDit
from .fast.qkv import FUSED_QKV_PATTERN, fuse_qkv
from .fast.text import batch_prompts, text_lengths
from .parallel.ulysses import FP8_EXCHANGE_BACKENDS, SequenceShards, padded_length

__all__ = [
    "FUSED_QKV_PATTERN",
    "SHIPPED",
    "TEXT_PADDING_MODES",
    "ForwardOptions",
    "PreparedDit",
    "batch_prompts",
    "fast_model_fn",
    "forward_shape",
    "fuse_qkv",
    "kernel_plan",
    "text_lengths",
]

logger = logging.getLogger(__name__)

TEXT_PADDING_MODES = ("split", "mask")
"""``split``: per-sample attention over the valid keys (every backend, exact); ``mask``: one SDPA call with
a boolean key mask (SDPA backends only, no host-side lengths needed)."""

_UNSUPPORTED = ("blockwise_controlnet_conditioning", "entity_prompt_emb", "layer_num", "layer_input_latents",
                "context_latents", "kv_cache")


def _reject_unsupported(kwargs: dict) -> None:
    used = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if kwargs.get("enable_fp8_attention"):
        used.append("enable_fp8_attention (use attention_backend='triton_fp8')")
    if used:
        raise NotImplementedError(
            f"fast_model_fn does not support {', '.join(used)}; use diffsynth's model_fn_qwen_image for them"
        )


def _patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, 2h, 2w) -> (B, h * w, C * 4): DiffSynth's ``B C (H P) (W Q) -> B (H W) (C P Q)``."""
    b, c, hh, ww = latents.shape
    if hh % 2 or ww % 2:
        raise ValueError(f"latent height and width must be even, got {tuple(latents.shape)}")
    x = latents.view(b, c, hh // 2, 2, ww // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (hh // 2) * (ww // 2), c * 4)


def _unpatchify(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h * w, C * 4) -> (B, C, 2h, 2w): DiffSynth's ``B (H W) (C P Q) -> B C (H P) (W Q)`` for any B."""
    b, _, ch = x.shape
    return x.view(b, h, w, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, ch // 4, 2 * h, 2 * w)


def _resolve_lengths(prepared: PreparedDit, mask: torch.Tensor, batch: int, text_len: int,
                     txt_seq_lens: Sequence[int] | None) -> tuple[int, ...] | None:
    """Valid text tokens per sample, or None when nothing is padded (one batched attention call)."""
    if mask is None or mask.shape != (batch, text_len):
        shape = None if mask is None else tuple(mask.shape)
        raise ValueError(f"prompt_emb_mask must be (B, L) = ({batch}, {text_len}), got {shape}")
    if txt_seq_lens is None:
        lens = prepared.text_lengths(mask)
    else:
        lens = tuple(int(n) for n in txt_seq_lens)
        if len(lens) != batch or any(not 1 <= n <= text_len for n in lens):
            raise ValueError(f"txt_seq_lens must give 1..{text_len} valid tokens for each of {batch} samples, "
                             f"got {lens}")
    if any(n < 1 for n in lens):
        raise ValueError(f"every prompt needs at least one valid text token, got lengths {lens}")
    return None if all(n == text_len for n in lens) else lens


def _prepared(dit: PreparedDit | torch.nn.Module) -> PreparedDit:
    """``dit`` as a :class:`PreparedDit` (a plain module gets one for this call only: eager, no graphs, nothing
    kept)."""
    return dit if isinstance(dit, PreparedDit) else PreparedDit(dit)


def forward_shape(latents: torch.Tensor, timestep: torch.Tensor, prompt_emb: torch.Tensor,
                  edit_latents: torch.Tensor | Sequence[torch.Tensor] | None = None, zero_cond_t: bool = False,
                  text_padding: str = "split") -> ForwardShape:
    """The :class:`~.fast.kernel_plan.ForwardShape` of a forward with these inputs (shapes as :func:`fast_model_fn`)."""
    refs = [] if edit_latents is None else ([edit_latents] if isinstance(edit_latents, torch.Tensor)
                                            else list(edit_latents))
    batch, _, lat_h, lat_w = latents.shape
    target = (lat_h // 2) * (lat_w // 2)
    image = target + sum((r.shape[2] // 2) * (r.shape[3] // 2) for r in refs)
    rows = timestep.numel()
    return ForwardShape(batch=int(batch), image_tokens=int(image), target_tokens=int(target),
                        text_tokens=int(prompt_emb.shape[1]), timestep_rows=int(rows), zero_cond_t=bool(zero_cond_t),
                        text_mask=text_padding == "mask", dtype=latents.dtype)


def kernel_plan(dit: PreparedDit | torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor,
                prompt_emb: torch.Tensor, edit_latents: torch.Tensor | Sequence[torch.Tensor] | None = None,
                zero_cond_t: bool = False, attention_backend: str = "sdpa", *, text_padding: str = "split",
                options: ForwardOptions = SHIPPED, **ignored) -> KernelPlan:
    """The :class:`~.fast.kernel_plan.KernelPlan` :func:`fast_model_fn` uses for these arguments (no forward runs).

    Takes :func:`fast_model_fn`'s arguments (the ones it does not need are ignored).
    """
    shape = forward_shape(latents, timestep, prompt_emb, edit_latents, zero_cond_t, text_padding)
    return _prepared(dit).kernels(options, attention_backend, shape, latents.device)


@torch.no_grad()
def fast_model_fn(
    dit: PreparedDit | torch.nn.Module,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    prompt_emb: torch.Tensor,
    prompt_emb_mask: torch.Tensor,
    height: int,
    width: int,
    edit_latents: torch.Tensor | Sequence[torch.Tensor] | None = None,
    zero_cond_t: bool = False,
    attention_backend: str = "sdpa",
    *,
    txt_seq_lens: Sequence[int] | None = None,
    text_padding: str = "split",
    edit_rope_interpolation: bool = False,
    options: ForwardOptions = SHIPPED,
    sequence_shards: SequenceShards | None = None,
    **ignored,
) -> torch.Tensor:
    """DiffSynth's ``model_fn_qwen_image`` for batch B >= 1: the DiT's velocity prediction.

    Args:
        dit: a :class:`PreparedDit` (compiled blocks, CUDA graphs and the caches it keeps), or a DiffSynth
            ``QwenImageDiT`` (e.g. ``SizedQwenImageDiT``, optionally after :func:`fuse_qkv` and
            ``fp8.quantize_linears``), run eagerly with nothing kept between calls.
        latents: (B, 16, H/8, W/8) noisy latents in the model dtype (bf16 or fp32).
        timestep: (1,) or (B,) in [0, 1000] (DiffSynth's scale; divided by 1000 here as there).
        prompt_emb: (B, L, T) text-encoder states, right-padded to the longest prompt.
        prompt_emb_mask: (B, L) 1 for valid text tokens, then 0 for padding.
        height, width: image size in pixels (latents are height/8 x width/8).
        edit_latents: None, a tensor or a list of reference latents, each (1 or B, 16, h_i/8, w_i/8).
        zero_cond_t: Qwen-Image-Edit-2511: reference tokens are modulated with timestep 0.
        attention_backend: a name from ``fp8.attention.BACKENDS`` (``text_padding="mask"``: one of
            ``"sdpa"``, ``"sdpa_math"``, ``"sdpa_efficient"``, ``"sdpa_cudnn"``).
        txt_seq_lens: valid text tokens per sample, known on the host (e.g. from :func:`batch_prompts`);
            None: read from ``prompt_emb_mask`` once per mask tensor (one host sync the first time).
        text_padding: how padded text is kept out of attention (:data:`TEXT_PADDING_MODES`).
        edit_rope_interpolation: DiffSynth's option of the same name.
        options: the fused kernels the forward may use (:class:`ForwardOptions`; :func:`kernel_plan` says which
            run).
        sequence_shards: None, or this rank's place in a Ulysses sequence-parallel group
            (:class:`..parallel.ulysses.SequenceShards`): every rank of the group calls with the same arguments, each
            runs the blocks on its slice of the tokens, the attention over all of them (two all-to-alls per block),
            and every rank returns the whole prediction (one all-gather). Runs kernel by kernel (no CUDA graphs),
            ``text_padding="split"`` only, the last block untrimmed; ``cudnn_fp8`` through its generic call.
        ignored: other ``model_fn_qwen_image`` arguments that do not change the result here
            (``progress_id``, ``use_gradient_checkpointing``, ...); features it does not support raise.

    With :meth:`PreparedDit.enable_cuda_graphs` (Compile Model's ``cuda_graphs``), CUDA calls run as one captured
    CUDA graph per input signature (:mod:`.fast.graphs`).

    Returns:
        (B, 16, H/8, W/8) prediction in the model dtype. For B = 1 and an unpadded prompt this equals
        ``model_fn_qwen_image`` (fp32 rel. error ~1e-7); sample i of a batch equals a batch-1 call with
        prompt i (its valid tokens only).
    """
    _reject_unsupported(ignored)
    if not isinstance(options, ForwardOptions):
        raise TypeError(f"options must be a ForwardOptions, got {type(options).__name__}")
    prepared = _prepared(dit)
    refs = None if edit_latents is None else (
        [edit_latents] if isinstance(edit_latents, torch.Tensor) else list(edit_latents))
    if text_padding not in TEXT_PADDING_MODES:
        raise ValueError(f"text_padding={text_padding!r}; allowed: {', '.join(TEXT_PADDING_MODES)}")
    plan = prepared.kernels(options, attention_backend,
                            forward_shape(latents, timestep, prompt_emb, refs, zero_cond_t, text_padding),
                            latents.device)
    graphs = prepared.graphs
    if (graphs is not None and sequence_shards is None and latents.is_cuda
            and not torch.cuda.is_current_stream_capturing()):
        if text_padding == "split" and txt_seq_lens is None and prompt_emb_mask is not None:
            txt_seq_lens = prepared.text_lengths(prompt_emb_mask)  # on the host, before anything is captured
        inputs = {"latents": latents, "timestep": timestep, "prompt_emb": prompt_emb,
                  "prompt_emb_mask": prompt_emb_mask, "edit_latents": refs}
        settings = {"height": height, "width": width, "zero_cond_t": zero_cond_t,
                    "attention_backend": attention_backend, "text_padding": text_padding,
                    "edit_rope_interpolation": edit_rope_interpolation, "plan": plan,
                    "txt_seq_lens": None if txt_seq_lens is None else tuple(int(n) for n in txt_seq_lens)}
        return graphs.run(prepared.module, lambda module, **kw: _forward(prepared, **kw), inputs, settings)
    return _forward(prepared, latents, timestep, prompt_emb, prompt_emb_mask, height, width, refs, zero_cond_t,
                    attention_backend, txt_seq_lens, text_padding, edit_rope_interpolation, plan, sequence_shards)


def _forward(prepared: PreparedDit, latents: torch.Tensor, timestep: torch.Tensor, prompt_emb: torch.Tensor,
             prompt_emb_mask: torch.Tensor, height: int, width: int, edit_latents: list[torch.Tensor] | None,
             zero_cond_t: bool, attention_backend: str, txt_seq_lens: Sequence[int] | None, text_padding: str,
             edit_rope_interpolation: bool, plan: KernelPlan, shards: SequenceShards | None = None) -> torch.Tensor:
    """The forward of :func:`fast_model_fn` (arguments checked here, except the unsupported ones)."""
    dit = prepared.module
    if text_padding not in TEXT_PADDING_MODES:
        raise ValueError(f"text_padding={text_padding!r}; allowed: {', '.join(TEXT_PADDING_MODES)}")
    if text_padding == "mask" and attention_backend not in MASK_BACKENDS:
        raise ValueError(f"text_padding='mask' needs an SDPA backend ({', '.join(MASK_BACKENDS)}), "
                         f"not {attention_backend!r}; use text_padding='split'")
    batch, _, lat_h, lat_w = latents.shape
    h, w = lat_h // 2, lat_w // 2
    if (h, w) != (height // 16, width // 16):
        raise ValueError(f"latents {tuple(latents.shape)} do not match height={height}, width={width}")
    if prompt_emb.dim() != 3 or prompt_emb.shape[0] != batch:
        raise ValueError(f"prompt_emb must be (B={batch}, L, T), got {tuple(prompt_emb.shape)}")
    device = latents.device
    text_len = prompt_emb.shape[1]

    # Image tokens: target, then each reference (expanded to the batch), as DiffSynth concatenates them.
    refs = edit_latents or []
    img_shapes = [(1, h, w)]
    parts = [_patchify(latents)]
    for i, ref in enumerate(refs):
        if ref.dim() != 4 or ref.shape[0] not in (1, batch):
            raise ValueError(f"edit_latents[{i}] must be (1 or {batch}, C, h, w), got {tuple(ref.shape)}")
        img_shapes.append((1, ref.shape[2] // 2, ref.shape[3] // 2))
        tokens = _patchify(ref)
        parts.append(tokens.expand(batch, -1, -1) if tokens.shape[0] != batch else tokens)
    target_tokens = h * w
    image = dit.img_in(torch.cat(parts, dim=1))
    image_tokens = image.shape[1]

    # Conditioning: (Bt, D), or (2 Bt, D) = [t; 0] for zero_cond_t.
    t = timestep.reshape(-1) / 1000
    if t.shape[0] not in (1, batch):
        raise ValueError(f"timestep must have 1 or B={batch} entries, got {tuple(timestep.shape)}")
    if zero_cond_t:
        t = torch.cat([t, t * 0])
    extra = None
    if dit.time_text_embed.use_additional_t_cond:
        extra = torch.zeros(1, dtype=torch.long, device=device)
    conditioning = dit.time_text_embed(t, image.dtype, addition_t_cond=extra)
    text = dit.txt_in(dit.txt_norm(prompt_emb))

    table_len = text_len if shards is None else padded_length(text_len, shards.degree)
    cos, sin = prepared.rope_tables(img_shapes, table_len, device, interpolation=edit_rope_interpolation)
    selector = prepared.target_selector(target_tokens, image_tokens, device) if zero_cond_t else None
    key_mask = carriers = None
    if text_padding == "mask":
        if prompt_emb_mask is None or prompt_emb_mask.shape != (batch, text_len):
            raise ValueError(f"prompt_emb_mask must be (B, L) = ({batch}, {text_len})")
        valid = torch.cat([torch.ones(batch, image_tokens, dtype=torch.bool, device=device),
                           prompt_emb_mask.to(device=device, dtype=torch.bool)], dim=1)
        key_mask = valid[:, None, None, :]
    else:
        lens = _resolve_lengths(prepared, prompt_emb_mask, batch, text_len, txt_seq_lens)
        carriers = None if lens is None else length_carriers(lens, device)
    sequence = None
    if shards is not None:
        if key_mask is not None:
            raise ValueError("text_padding='mask' cannot run under sequence parallel; use text_padding='split'")
        lens = lens or (text_len,) * batch
        image, text, cos, sin, selector, valid = shards.shard_forward(image, text, cos, sin, selector, lens)
        carriers = length_carriers(lens, device)
        sequence = (shards, valid)

    # img_in / txt_in outputs are views (F.linear on 3-D input); block outputs are not. Dynamo guards views
    # on their base, so the first block would get a graph of its own: hand it fresh tensors (one small copy).
    image, text = image.clone(), text.clone()
    temb_img = F.silu(conditioning)
    temb_txt = temb_img[: temb_img.shape[0] // 2] if zero_cond_t else temb_img
    compiled = prepared.compiled
    block_fn = fast_block if compiled is None else compiled.fn
    mark = compiled is not None and compiled.marks_sequence_dynamic
    if mark:
        mark_sequence_dynamic((cos, 0), (sin, 0), (selector, 1), (key_mask, 3),
                              *((c, 0) for c in carriers or ()), *(() if sequence is None else ((sequence[1], 0),)))
    mods = block_modulations(prepared.modulation_groups(), temb_img, temb_txt) if plan.shared_modulation else None
    last = len(dit.transformer_blocks) - 1
    target = length_carriers((target_tokens,), device)[0] if plan.trim_last_block and shards is None else None
    if mark:
        mark_sequence_dynamic((target, 0))
    kernels = plan.block
    if shards is not None:  # cudnn_fp8's fused quantization kernels feed its own joint-sequence call, not the exchange
        kernels = dataclasses.replace(kernels, qk_quant=False, v_quant=False, joint_v_gemm=False,
                                      traced_exchange=plan.options.ulysses_traced_exchange,
                                      fp8_exchange=plan.options.ulysses_fp8_exchange
                                      and attention_backend in FP8_EXCHANGE_BACKENDS)
    streaming = prepared.streaming
    for i, block in enumerate(dit.transformer_blocks):
        if mark:
            mark_sequence_dynamic((image, 1), (text, 1))
        streamed = streaming is not None and streaming.streams(block)
        if streamed:
            streaming.onload(block)
        image, text = block_fn(block, image, text, temb_img, temb_txt, cos, sin, selector, carriers, key_mask,
                               attention_backend, kernels, None if mods is None else mods[i],
                               target if i == last else None, sequence)
        if streamed:
            streaming.offload(block)

    out_cond = conditioning[: conditioning.shape[0] // 2] if zero_cond_t else conditioning
    if shards is not None:  # every rank's output rows (the small proj_out output), then the target's
        image = shards.gather(dit.proj_out(dit.norm_out(image, out_cond)), 1)[:, :target_tokens]
        return _unpatchify(image, h, w)
    image = dit.proj_out(dit.norm_out(image[:, :target_tokens], out_cond))
    return _unpatchify(image, h, w)
