"""The pack's fused block (``qwen_edit.fast.block.fast_block``) on ComfyUI's Qwen-Image blocks, through ComfyUI's
block-replacement hook.

:func:`set_block_replace` puts one :class:`ReplacedBlock` per transformer block into the MODEL clone's
``transformer_options["patches_replace"]["dit"][("double_block", i)]`` (``ModelPatcher.set_model_patch_replace``,
what ComfyUI's own nodes do) and a ``DIFFUSION_MODEL`` wrapper (:class:`CallFacts`) that tells the replacement,
per model call, which DiT runs and the text attention mask that came with the call, and :mod:`.text_padding`'s
``CALC_COND_BATCH`` wrapper. Nothing in ComfyUI is patched process-wide; :func:`remove_block_replace` takes them
off a clone again.

ComfyUI's forward (0.3.75 and 0.33) calls the replacement with ``{"img", "txt", "vec", "pe",
"transformer_options"}`` and ``{"original_block"}`` and takes ``{"img", "txt"}`` back:

* ``img``: (B, S_img, D) image tokens (target, then references), the model's compute dtype (bf16 on the GPU);
* ``txt``: (B, L, D) text tokens;
* ``vec``: (B, D) timestep embedding; the block's ``img_mod`` / ``txt_mod`` are ``Sequential(SiLU, Linear)``, so
  ``fast_block`` gets ``silu(vec)``;
* ``pe``: (B or 1, 1, L + S_img, Dh / 2, 2, 2) RoPE rotation matrices ``[[cos, -sin], [sin, cos]]`` for the
  interleaved channel pairs (2i, 2i + 1) (``comfy.ldm.flux.math.apply_rope1``), rows in ComfyUI's token order
  ``[text, image]``, in the compute dtype. ``fast_block`` takes float32 (S_img + L, Dh / 2) ``cos`` and ``sin``
  tables in its order ``[image, text]`` with the same pairing (``qwen_edit.fast.rope.rope_real``), so the tables are
  ``pe[0, 0, ..., 0, 0]`` and ``pe[0, 0, ..., 1, 0]`` with the text rows moved last (attention does not depend on
  the token order when every token keeps its own RoPE row). They are made once per ``pe`` tensor (one per model
  call), and the batch's rows are checked equal then (one host sync per call).

A text attention mask (the call's ``attention_mask``, (B, L): prompts of different lengths in one batch, right
padded) runs ``fast_block`` with each sample's text length (``txt_lens``): padded keys are hidden from attention
and padded rows never reach the image stream. :mod:`.text_padding` pads KSampler's positive and negative texts to
one length that way, so a step is one batch-2 call instead of two batch-1 calls.

ComfyUI's own block runs instead (``original_block``), with one log line per reason, where ``fast_block`` would
compute something else:

* 2511's zero-timestep conditioning (0.33, ``index_timestep_zero``): ``vec`` then holds 2B rows and the block
  takes ``timestep_zero_index``, which the hook's arguments do not carry;
* a text mask that is not right padding (any other pattern, or additive values other than 0 and large negatives);
* RoPE positions that differ between the batch's samples; no :class:`CallFacts` for the call (the wrapper was
  taken off by someone else).

On a call whose texts :mod:`.text_padding` padded, ComfyUI's block is never the answer (0.3.75's block ignores text
masks): such a fallback raises instead.

Kernels: on CUDA, :meth:`...qwen_edit.fast.prepared.PreparedDit.kernels` (``select_kernels``) picks them per
shape, as the pack's fast forward does, with :func:`fused_block_options` (the shipped options without the
forward-level ones: modulation runs per block, and the last block returns every token because ComfyUI's forward
reads them). ComfyUI's MLP activation is ``GELU(tanh)``; the fused GELU kernels compute it in that form
(``qwen_edit.fast.mlp.kernel_gelu``). On any other device the block runs without fused
kernels (``BlockKernels()``). fp8 layers are those of :mod:`.fp8_model` (separate Q/K/V projections: ComfyUI's forward
never used fused ones).

Compile: when the MODEL carries :mod:`.compile`'s ``APPLY_MODEL`` wrapper (Compile Model), ``fast_block`` runs
through one ``torch.compile`` of it with that wrapper's mode, dynamic and extra arguments, shared by all blocks
(regional compile: the block module is an argument, its weights graph inputs).
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F  # noqa: N812

from .text_padding import PADDED_KEY, remove_text_padding, set_text_padding

logger = logging.getLogger(__name__)

FACTS_KEY = "qwen_edit_hopper.block_replace"
"""``transformer_options`` key of the per-call :class:`CallFacts`, and the key of the ``DIFFUSION_MODEL`` wrapper."""
PATCH_NAME, BLOCK_NAME = "dit", "double_block"


@functools.cache
def fused_block_options():
    """The shipped forward options without the forward-level ones (made once: every block of every call reads
    them)."""
    from ...qwen_edit.fast.options import SHIPPED

    return replace(SHIPPED, trim_last_block=False, shared_modulation=False)


MASKED_ADDITIVE = -1e4
"""An additive (float) text mask hides a token with a value at or below this (exp of it is 0 in float32)."""


def right_padding_lengths(mask: torch.Tensor, length: int) -> tuple[int, ...] | None:
    """Each sample's valid text tokens for a right-padding mask, or None for any other mask.

    mask: (B, L) with L == ``length``: integer or bool 1/0 (1: a token), or float additive (0: a token, at most
    :data:`MASKED_ADDITIVE`: hidden), as ComfyUI's Qwen-Image forward reads it. One host sync.
    """
    if mask.ndim != 2 or mask.shape[1] != length:
        return None
    if mask.is_floating_point():
        valid, hidden = mask == 0, mask <= MASKED_ADDITIVE
    else:
        valid, hidden = mask == 1, mask == 0
    lengths = valid.sum(dim=1)
    positions = torch.arange(length, device=mask.device)
    prefix = positions[None, :] < lengths[:, None]
    if not bool((valid | hidden).all()) or not torch.equal(valid, prefix):
        return None
    return tuple(int(n) for n in lengths.tolist())


@dataclass
class CallFacts:
    """What the hook's arguments do not say, for one model call: the DiT that runs and the text mask that came."""

    diffusion_model: torch.nn.Module
    text_mask: torch.Tensor | None
    _lengths: dict = field(default_factory=dict)

    def text_lengths(self, length: int) -> tuple[int, ...] | None:
        """:func:`right_padding_lengths` of the call's mask (made once per call)."""
        if length not in self._lengths:
            self._lengths[length] = right_padding_lengths(self.text_mask, length)
        return self._lengths[length]


class RecordCallFacts:
    """``DIFFUSION_MODEL`` wrapper: puts :class:`CallFacts` into the call's ``transformer_options``."""

    def __call__(self, executor, *args, **kwargs):
        import inspect

        bound = inspect.signature(executor.original).bind_partial(*args, **kwargs).arguments
        options = bound.get("transformer_options")
        if isinstance(options, dict):
            options[FACTS_KEY] = CallFacts(executor.class_obj, bound.get("attention_mask"))
        return executor(*args, **kwargs)


class FastBlocks:
    """The state the replacements share: the attention backend, log lines said, kernel plans and RoPE tables."""

    def __init__(self, backend: str):
        self.backend = backend
        self._said: set[str] = set()
        self._prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._tables: tuple | None = None
        self.last_kernels = None
        """The ``BlockKernels`` of the latest fused block (tests and the GPU bench read it)."""

    def fallback(self, reason: str, args: dict, original_block) -> dict:
        if args["transformer_options"].get(PADDED_KEY):
            raise RuntimeError(f"fused block: ComfyUI's own block would run ({reason}) on texts that the pack padded "
                               "to one length, and ComfyUI's block does not hide padding on every version; remove "
                               "what causes it, or set Apply TE-FP8's model_block to comfyui")
        if reason not in self._said:
            self._said.add(reason)
            logger.warning("fused block: ComfyUI's own block runs (%s)", reason)
        return original_block(args)

    def kernels(self, model: torch.nn.Module, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor,
                transformer_options: dict):
        from ...qwen_edit.fast.block_kernels import BlockKernels
        from ...qwen_edit.fast.kernel_plan import ForwardShape
        from ...qwen_edit.fast.prepared import PreparedDit

        if img.device.type != "cuda":
            return BlockKernels()
        prepared = self._prepared.get(model)
        if prepared is None:
            prepared = self._prepared[model] = PreparedDit(model)
        references = sum(transformer_options.get("reference_image_num_tokens", ()))
        shape = ForwardShape(batch=img.shape[0], image_tokens=img.shape[1], target_tokens=img.shape[1] - references,
                             text_tokens=txt.shape[1], timestep_rows=vec.shape[0], zero_cond_t=False,
                             text_mask=False, dtype=img.dtype)
        return prepared.kernels(fused_block_options(), self.backend, shape, img.device).block

    def tables(self, pe: torch.Tensor, text_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin), each (S_img + L, Dh / 2) float32 in ``[image, text]`` order, or None when the batch's
        samples have different positions. Made once per ``pe`` tensor."""
        held = self._tables
        if held is not None and held[0]() is pe and held[1] == text_tokens:
            return held[2]
        if pe.shape[0] > 1 and not all(torch.equal(pe[0], pe[b]) for b in range(1, pe.shape[0])):
            return None
        rows = pe[0, 0].float()
        rows = torch.cat([rows[text_tokens:], rows[:text_tokens]], dim=0)
        tables = rows[..., 0, 0].contiguous(), rows[..., 1, 0].contiguous()
        self._tables = (weakref.ref(pe), text_tokens, tables)
        return tables

    def block_function(self, transformer_options: dict):
        """``fast_block``, or its ``torch.compile`` when the MODEL carries Compile Model's wrapper."""
        from ...qwen_edit.fast.block import fast_block
        from .compile import compile_wrapper

        wrapper = compile_wrapper(transformer_options)
        return fast_block if wrapper is None else wrapper.compiled_function(fast_block)


class ReplacedBlock:
    """The ``("double_block", index)`` replacement: ``fast_block`` on the DiT's block ``index`` (see the module
    docstring for the arguments and when ComfyUI's own block runs instead)."""

    def __init__(self, shared: FastBlocks, index: int):
        self.shared = shared
        self.index = index

    def __repr__(self) -> str:
        return f"ReplacedBlock({self.index}, backend={self.shared.backend!r})"

    def __call__(self, args: dict, extra: dict) -> dict:
        from ...qwen_edit.fast.block import head_shape, length_carriers

        shared, original = self.shared, extra["original_block"]
        img, txt, vec, pe, options = args["img"], args["txt"], args["vec"], args["pe"], args["transformer_options"]
        facts = options.get(FACTS_KEY)
        if not isinstance(facts, CallFacts):
            return shared.fallback("the call carries no CallFacts: the DIFFUSION_MODEL wrapper did not run", args,
                                   original)
        if vec.shape[0] not in (1, img.shape[0]):
            return shared.fallback(
                f"the timestep embedding has {vec.shape[0]} rows for {img.shape[0]} samples: 2511's zero-timestep "
                "conditioning, whose reference-token index the hook does not pass", args, original)
        lengths = None
        if facts.text_mask is not None:
            lengths = facts.text_lengths(txt.shape[1])
            if lengths is None:
                return shared.fallback(f"a text attention mask of shape {tuple(facts.text_mask.shape)} that is not "
                                       "right padding", args, original)
        block = facts.diffusion_model.transformer_blocks[self.index]
        block = getattr(block, "_orig_mod", block)  # Compile Model's wrapper swaps in compiled modules
        head_dim = head_shape(block.attn)[1]
        if pe.shape[-4:] != (img.shape[1] + txt.shape[1], head_dim // 2, 2, 2):
            return shared.fallback(f"RoPE matrices of shape {tuple(pe.shape)}", args, original)
        tables = shared.tables(pe, txt.shape[1])
        if tables is None:
            return shared.fallback("RoPE positions that differ between the batch's samples", args, original)
        kernels = shared.kernels(facts.diffusion_model, img, txt, vec, options)
        shared.last_kernels = kernels
        temb = F.silu(vec)
        carriers = None
        if lengths is not None and any(n != txt.shape[1] for n in lengths):
            carriers = length_carriers(lengths, img.device)
        image, text = shared.block_function(options)(block, img, txt, temb, temb, *tables, None, carriers, None,
                                                     shared.backend, kernels)
        return {"img": image, "txt": text}


def set_block_replace(model, backend: str) -> FastBlocks:
    """Make ``model`` (a ComfyUI MODEL clone of ComfyUI's Qwen-Image DiT, changed in place) run ``fast_block`` with
    attention ``backend`` (``fp8.attention.BACKENDS``) on every transformer block."""
    from comfy.patcher_extension import WrappersMP

    shared = FastBlocks(backend)
    remove_block_replace(model)
    blocks = len(model.get_model_object("diffusion_model").transformer_blocks)
    for index in range(blocks):
        model.set_model_patch_replace(ReplacedBlock(shared, index), PATCH_NAME, BLOCK_NAME, index)
    model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, FACTS_KEY, RecordCallFacts())
    set_text_padding(model, replaced_blocks_of_options)
    return shared


def replaced_blocks_of_options(transformer_options: dict) -> list[int]:
    """Indices of the blocks that ``transformer_options`` (a MODEL's, or a model call's) run through a
    :class:`ReplacedBlock`."""
    dit = transformer_options.get("patches_replace", {}).get(PATCH_NAME, {})
    return sorted(key[1] for key, patch in dit.items() if isinstance(patch, ReplacedBlock))


def replaced_blocks(model) -> list[int]:
    """Indices of the blocks ``model`` runs through a :class:`ReplacedBlock`."""
    return replaced_blocks_of_options(model.model_options.get("transformer_options", {}))


def remove_block_replace(model) -> None:
    """Take this module's replacements and wrapper off ``model`` (a clone, changed in place); others' stay."""
    from comfy.patcher_extension import WrappersMP

    options = model.model_options.setdefault("transformer_options", {})
    dit = options.get("patches_replace", {}).get(PATCH_NAME)
    if dit:
        kept = {key: patch for key, patch in dit.items() if not isinstance(patch, ReplacedBlock)}
        options["patches_replace"] = {**options["patches_replace"], PATCH_NAME: kept}
    model.remove_wrappers_with_key(WrappersMP.DIFFUSION_MODEL, FACTS_KEY)
    remove_text_padding(model)
