"""The pack's attention backends inside ComfyUI's Qwen-Image forward, through ``optimized_attention_override``.

ComfyUI's attention functions call ``transformer_options["optimized_attention_override"](func, q, k, v, heads,
mask, ..., skip_reshape=..., ...)`` when the MODEL's options hold one (0.3.75 and 0.33). Qwen-Image calls it with
q, k, v as (B, H, S, D) (``skip_reshape=True``) and expects (B, S, H*D): exactly ``fp8.attention.attention``'s
contract. Calls the pack's backends cannot take (a text padding mask from batched prompts of different lengths,
another layout) run ComfyUI's own function, and the log says so once per reason.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_SAID: set[str] = set()


class PackAttention:
    """``optimized_attention_override`` running the pack's attention ``backend`` (a picklable, comparable value)."""

    def __init__(self, backend: str):
        self.backend = backend

    def __eq__(self, other) -> bool:
        return isinstance(other, PackAttention) and other.backend == self.backend

    def __hash__(self) -> int:
        return hash(("PackAttention", self.backend))

    def __repr__(self) -> str:
        return f"PackAttention({self.backend!r})"

    def __call__(self, func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        from ...fp8.attention import attention

        reason = _unsupported(q, k, v, heads, mask, skip_reshape, skip_output_reshape)
        if reason is not None:
            if reason not in _SAID:
                _SAID.add(reason)
                logger.warning("attention %s: ComfyUI's own attention runs this call (%s)", self.backend, reason)
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)
        return attention(q, k, v, backend=self.backend)


def _unsupported(q, k, v, heads, mask, skip_reshape, skip_output_reshape) -> str | None:
    if mask is not None:
        return "an attention mask (text padding of batched prompts)"
    if not skip_reshape or skip_output_reshape:
        return "a (B, S, H*D) layout"
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape or q.shape[1] != heads:
        return f"q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    return None


def set_attention(model, backend: str) -> None:
    """Make ``model`` (a ComfyUI MODEL clone, changed in place) run the pack's attention ``backend``."""
    options = model.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")
    if previous is not None and not isinstance(previous, PackAttention):
        logger.info("attention %s replaces the MODEL's attention override %r", backend, previous)
    options["optimized_attention_override"] = PackAttention(backend)
