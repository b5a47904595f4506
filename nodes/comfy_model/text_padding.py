"""One model call per step for prompts of different lengths: a ``CALC_COND_BATCH`` wrapper that right-pads the
conditions' texts to one length and says which tokens are padding.

ComfyUI batches conditions into one model call only when their tensors have equal shapes
(``comfy.samplers.can_concat_cond``). A positive and a negative prompt of different token counts (208 and 221 in
the edit workflow) therefore give KSampler two batch-1 model calls per step. The pack's fused block handles a
right-padded text batch exactly (``fast_block``'s ``txt_lens``: padded keys are hidden from attention, padded rows
are never read by the image stream), so :class:`PadTexts` gives every condition of a step the longest text:

* ``model_conds["c_crossattn"]``, (B, L_i, D_txt), is right-padded with zeros to (B, L, D_txt);
* ``model_conds["attention_mask"]``, (B, L) int64, 1 for the prompt's tokens and 0 for padding, is added (ComfyUI's
  own text-mask condition: 0.33's Qwen-Image forward reads it, 0.3.75's forward accepts it and its block ignores
  it; the fused block reads it on both, see :mod:`.block_replace`).

ComfyUI's batching then concatenates them (when nothing else differs) into one batch-2 call. The conditions are
copied, never changed in place (the sampler's own lists stay as they were), and the call's ``transformer_options``
carry :data:`PADDED_KEY`, so a block that cannot honour the padding fails loudly instead of mixing padded tokens into
the image (:mod:`.block_replace`).

Padding is used only where every block of the call runs the fused block: the MODEL runs a
:class:`.block_replace.ReplacedBlock` on every transformer block, carries no other ``transformer_options["patches"]``
(a patch may read the text stream), its conditions carry no mask of their own and no ControlNet or GLIGEN (their own
blocks read the text), and the model is not 2511's zero-timestep variant (whose blocks run ComfyUI's own).
Otherwise the conditions pass unchanged, and the reason is logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

WRAPPER_KEY = "qwen_edit_hopper.text_padding"
"""Key of the ``CALC_COND_BATCH`` wrapper on the MODEL clone."""
PADDED_KEY = "qwen_edit_hopper.text_padded"
"""``transformer_options`` key set on model calls whose texts :class:`PadTexts` padded."""
ZERO_TIMESTEP = "index_timestep_zero"


def text_length(cond: dict) -> int | None:
    """The token count of a processed condition's ``c_crossattn`` (B, L, D), or None when it has none."""
    model_conds = cond.get("model_conds", {})
    crossattn = model_conds.get("c_crossattn")
    tensor = getattr(crossattn, "cond", None)
    if not isinstance(tensor, torch.Tensor) or tensor.ndim != 3:
        return None
    return int(tensor.shape[1])


def padded_condition(cond: dict, length: int) -> dict:
    """A copy of ``cond`` whose text is right-padded with zeros to ``length`` tokens, with the (B, length) int64
    ``attention_mask`` condition (1: the prompt's tokens, 0: padding)."""
    from comfy.conds import CONDRegular

    model_conds = dict(cond["model_conds"])
    crossattn = model_conds["c_crossattn"]
    text = crossattn.cond
    batch, own = text.shape[0], text.shape[1]
    mask = torch.zeros(batch, length, dtype=torch.int64, device=text.device)
    mask[:, :own] = 1
    if own < length:
        text = torch.cat([text, text.new_zeros(batch, length - own, text.shape[2])], dim=1)
    model_conds["c_crossattn"] = crossattn._copy_with(text)
    model_conds["attention_mask"] = CONDRegular(mask)
    return {**cond, "model_conds": model_conds}


def pad_conds(conds: list, length: int) -> list:
    """``conds`` (the sampler's per-prompt lists of processed conditions, entries may be None) with every
    condition that has a text padded to ``length`` tokens (:func:`padded_condition`); new lists and dicts."""
    return [None if group is None else
            [padded_condition(cond, length) if text_length(cond) is not None else cond for cond in group]
            for group in conds]


class PadTexts:
    """``CALC_COND_BATCH`` wrapper: right-pads the step's texts to one length (module docstring).

    ``fused_blocks``: the indices of the blocks that a call's ``transformer_options`` run through the fused block
    (:func:`.block_replace.replaced_blocks_of_options`).
    """

    def __init__(self, fused_blocks: Callable[[dict], list[int]]):
        self.fused_blocks = fused_blocks
        self._said: set[str] = set()
        self._padded = False

    def _skip(self, reason: str) -> None:
        if reason not in self._said:
            self._said.add(reason)
            logger.info("text padding: prompts of different lengths run as ComfyUI batches them (%s)", reason)

    def why_not(self, model, conds: list, model_options: dict) -> str | None:
        """Why this call's texts must not be padded, or None when they can be."""
        options = model_options.get("transformer_options", {})
        blocks = len(model.diffusion_model.transformer_blocks)
        if self.fused_blocks(options) != list(range(blocks)):
            return "not every transformer block runs the pack's fused block"
        if any(options.get("patches", {}).values()):
            return f"the MODEL carries transformer patches ({', '.join(sorted(options['patches']))})"
        if getattr(model.diffusion_model, "default_ref_method", None) == ZERO_TIMESTEP:
            return "2511's zero-timestep conditioning runs ComfyUI's own block"
        for group in conds:
            for cond in group or ():
                if cond.get("control") is not None or cond.get("gligen") is not None:
                    return "a ControlNet or GLIGEN on a condition reads the text with its own blocks"
                model_conds = cond.get("model_conds", {})
                if "attention_mask" in model_conds:
                    return "a condition carries its own text attention mask"
                if getattr(model_conds.get("ref_latents_method"), "cond", None) == ZERO_TIMESTEP:
                    return "2511's zero-timestep conditioning runs ComfyUI's own block"
        return None

    def __call__(self, executor, model, conds, x_in, timestep, model_options):
        lengths = {text_length(cond) for group in conds for cond in group or ()} - {None}
        if len(lengths) > 1:
            reason = self.why_not(model, conds, model_options)
            if reason is None:
                if not self._padded:
                    self._padded = True
                    logger.info("text padding: texts of %s tokens padded to %d, one model call for the step's "
                                "prompts (said once)", " and ".join(map(str, sorted(lengths))), max(lengths))
                conds = pad_conds(conds, max(lengths))
                options = {**model_options.get("transformer_options", {}), PADDED_KEY: True}
                model_options = {**model_options, "transformer_options": options}
            else:
                self._skip(reason)
        return executor(model, conds, x_in, timestep, model_options)


def set_text_padding(model, fused_blocks: Callable[[dict], list[int]]) -> PadTexts:
    """Add :class:`PadTexts` to ``model`` (a ComfyUI MODEL clone, changed in place)."""
    from comfy.patcher_extension import WrappersMP

    wrapper = PadTexts(fused_blocks)
    remove_text_padding(model)
    model.add_wrapper_with_key(WrappersMP.CALC_COND_BATCH, WRAPPER_KEY, wrapper)
    return wrapper


def remove_text_padding(model) -> None:
    """Take :class:`PadTexts` off ``model`` (a clone, changed in place)."""
    from comfy.patcher_extension import WrappersMP

    model.remove_wrappers_with_key(WrappersMP.CALC_COND_BATCH, WRAPPER_KEY)
