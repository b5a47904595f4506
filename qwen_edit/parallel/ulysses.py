"""Ulysses sequence parallel: each rank holds a slice of the joint sequence, attention runs over all of it.

Every op of a Qwen-Image block except the joint attention is per token (modulation, LayerNorm, Q/K/V, QK RMSNorm,
RoPE with each token's own table rows, output projections, MLPs). So each of P ranks keeps ``S_img / P`` image
tokens and ``L_p / P`` text tokens (text right-padded to a multiple of P, padding kept out of attention as true
CFG's padding is), and only around the attention do the ranks trade: one all-to-all turns q, k, v from
(B, S / P, H, Dh) into (B, S, H / P, Dh) (the whole sequence, a slice of the heads), the user's attention backend
runs on that, and one all-to-all turns the output back into (B, S / P, H * Dh).

The exchange is an all-to-all over the group (NCCL on GPUs, gloo on the CPU). ``ForwardOptions.ulysses_traced_exchange``
(through ``BlockKernels.traced_exchange``) chooses how it meets ``torch.compile``: off, the whole attention section
(the exchange's layout changes, ``torch.distributed.all_to_all_single``, the backend's quantization and call) runs
eagerly outside the graph (``torch.compiler.disable``) and a compiled block runs as two graphs around it; on, the
all-to-alls are functional collectives (``torch.distributed._functional_collectives``), which Dynamo traces, and
the block with its exchange is one graph, Inductor's fused code around the collectives.

``ForwardOptions.ulysses_fp8_exchange`` (through ``BlockKernels.fp8_exchange``; cuDNN FP8 attention only) sends q, k
and v as e4m3 and gets the attention's e4m3 output back: half the bytes of every all-to-all. The ranks agree on one
per-tensor scale each for q, k and v first (an all-reduce of three maxima), the scales one process computes over
the whole q, k and v, so the attention sees the codes one process would quantize. On in the shipped options (decision
0014 has the A/B).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F  # noqa: N812

from ...fp8.attention.cudnn_fp8 import E4M3_MAX, attention_quantized
from ..fast.block import joint_attention, per_sample_attention

__all__ = ["FP8_EXCHANGE_BACKENDS", "SequenceShards", "exchange_dtype_note", "padded_length"]

FP8_EXCHANGE_BACKENDS = ("cudnn_fp8", "cudnn_fp8_emulated")
"""Attention backends that take e4m3 q, k, v with per-tensor scales, which an fp8 exchange can feed."""


def exchange_dtype_note(fp8_exchange: bool, backend: str) -> str:
    """What the Ulysses exchange carries, for the run's notes (``ForwardOptions.ulysses_fp8_exchange``)."""
    if not fp8_exchange:
        return "q, k, v and the attention output exchanged in the compute dtype"
    if backend in FP8_EXCHANGE_BACKENDS:
        return "q, k, v and the attention output exchanged as e4m3 (one scale per tensor over all ranks)"
    return (f"q, k, v and the attention output exchanged in the compute dtype: ulysses_fp8_exchange feeds cuDNN FP8 "
            f"attention, and the attention here is {backend}")


def padded_length(length: int, degree: int) -> int:
    """``length`` rounded up to a multiple of ``degree``."""
    return -(-length // degree) * degree


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; the result's chunk j came from rank j (same shape; ``x`` contiguous)."""
    out = torch.empty_like(x)  # contiguous too: the collective writes rank-major chunks
    dist.all_to_all_single(out, x, group=group)
    return out


def _traced_all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """:func:`_all_to_all` as a functional collective, which Dynamo traces into the compiled graph (no break)."""
    return funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group))


def _all_max(x: torch.Tensor, group) -> torch.Tensor:
    """The elementwise maximum of ``x`` over the group's ranks (a new tensor)."""
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def _traced_all_max(x: torch.Tensor, group) -> torch.Tensor:
    """:func:`_all_max` as a functional collective (traced into the compiled graph)."""
    return funcol.wait_tensor(funcol.all_reduce(x, "max", group))


@dataclass(frozen=True, eq=False)
class SequenceShards:
    """This rank's place in a sequence-parallel group of ``degree`` ranks.

    Attributes:
        group: the ``torch.distributed`` process group of the ranks that share one forward's sequence.
        degree: P, the number of ranks in it.
        rank: this rank's index in it (its shard of every sequence is the ``rank``-th of P equal slices).
    """

    group: object
    degree: int
    rank: int

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of ``x`` along ``dim`` (its size must divide by P)."""
        size = x.shape[dim]
        if size % self.degree:
            raise ValueError(f"sequence length {size} does not divide by the sequence-parallel degree {self.degree}")
        return x.narrow(dim, self.rank * (size // self.degree), size // self.degree)

    @torch.compiler.disable
    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The shards of all ranks concatenated along ``dim`` (rank order)."""
        parts = [torch.empty_like(x) for _ in range(self.degree)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image_tokens: int,
                  image_valid: torch.Tensor, txt_lens: tuple[torch.Tensor, ...], backend: str,
                  traced: bool = False, fp8: bool = False) -> torch.Tensor:
        """Joint attention of the whole sequence from this rank's shard (arguments: :meth:`_attention`); ``traced``:
        the section and its functional collectives run where they are called (traced into a compiled block), else
        eagerly outside any graph; ``fp8``: the exchange carries e4m3 (``backend`` in
        :data:`FP8_EXCHANGE_BACKENDS`, else ValueError)."""
        if fp8 and backend not in FP8_EXCHANGE_BACKENDS:
            raise ValueError(f"an fp8 Ulysses exchange feeds cuDNN FP8 attention ({', '.join(FP8_EXCHANGE_BACKENDS)}),"
                             f" not {backend}: turn ForwardOptions.ulysses_fp8_exchange off for it")
        args = (q, k, v, image_tokens, image_valid, txt_lens, backend)
        if traced:
            return self._attention(*args, _traced_all_to_all, _traced_all_max if fp8 else None)
        return self._eager_attention(*args, _all_to_all, _all_max if fp8 else None)

    @torch.compiler.disable
    def _eager_attention(self, *args) -> torch.Tensor:
        return self._attention(*args)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image_tokens: int,
                   image_valid: torch.Tensor, txt_lens: tuple[torch.Tensor, ...], backend: str,
                   exchange: Callable[[torch.Tensor, object], torch.Tensor],
                   all_max: Callable[[torch.Tensor, object], torch.Tensor] | None = None) -> torch.Tensor:
        """Joint attention of the whole sequence from this rank's shard.

        Args:
            q, k, v: (B, s_img + s_txt, H, Dh), this rank's image tokens then its text tokens (after QK norm and
                RoPE).
            image_tokens: s_img, this rank's image tokens (P * s_img >= the valid image tokens: the last shard may
                end in padding).
            image_valid: (N, 0) size carrier: N valid image tokens in all (the padding after them is no key).
            txt_lens: valid text tokens per sample as (n_i, 0) size carriers (``fast.block.length_carriers``).
            backend: the attention backend (``fp8.attention.BACKENDS``).
            exchange: the all-to-all (:func:`_all_to_all` or :func:`_traced_all_to_all`).
            all_max: None: q, k, v and the output travel in their dtype; else the group's maximum
                (:func:`_all_max` or :func:`_traced_all_max`): they travel as e4m3 (``backend`` a cuDNN FP8 one).

        Returns:
            (B, s_img + s_txt, H * Dh): this rank's rows of the attention output, all heads.
        """
        p = self.degree
        b, s_local, heads, dh = q.shape
        if heads % p:
            raise ValueError(f"{heads} attention heads do not divide by the sequence-parallel degree {p}")
        hp, valid = heads // p, image_valid.shape[0]
        qkv = torch.stack([q, k, v])
        descales = None
        if all_max is not None:  # one scale per tensor over every rank's rows: one process's per-tensor scales
            bounds = all_max(qkv.abs().amax(dim=(1, 2, 3, 4)).float(), self.group).clamp_min(1e-12)
            descales = (bounds / E4M3_MAX).reshape(3, 1, 1, 1, 1)  # cudnn_fp8.quantize_with_bound's codes
            qkv = (qkv.float() * (E4M3_MAX / bounds).reshape(3, 1, 1, 1, 1)).to(torch.float8_e4m3fn).view(torch.uint8)
        send = qkv.view(3, b, s_local, p, hp, dh).permute(3, 0, 1, 2, 4, 5)  # (P, 3, B, s, H/P, Dh)
        got = exchange(send.contiguous(), self.group)  # chunk j: rank j's tokens, this rank's heads
        img = got[:, :, :, :image_tokens].permute(1, 2, 0, 3, 4, 5).reshape(3, b, p * image_tokens, hp, dh)
        txt = got[:, :, :, image_tokens:].permute(1, 2, 0, 3, 4, 5).reshape(3, b, p * (s_local - image_tokens), hp,
                                                                              dh)
        # Valid image tokens, text, then the image padding: valid keys first, as joint_attention wants them.
        joint = torch.cat([img[:, :, :valid], txt, img[:, :, valid:]], dim=2).transpose(2, 3)  # (3, B, H/P, S, Dh)
        if descales is None:
            out = joint_attention(joint[0], joint[1], joint[2], valid, txt_lens, None, backend).view(b, -1, hp, dh)
        else:  # e4m3 codes (as uint8) in, e4m3 codes in units of v's scale out
            out = _quantized_joint_attention(joint.view(torch.float8_e4m3fn), descales, valid, txt_lens,
                                             backend == "cudnn_fp8_emulated").view(b, -1, hp, dh)
        text_total = txt.shape[2]
        img_out = torch.cat([out[:, :valid], out[:, valid + text_total:]], dim=1).view(b, p, image_tokens, hp, dh)
        txt_out = out[:, valid: valid + text_total].reshape(b, p, s_local - image_tokens, hp, dh)
        back = torch.cat([img_out, txt_out], dim=2).permute(1, 0, 2, 3, 4)  # (P, B, s, H/P, Dh): chunk j to rank j
        got = exchange(back.contiguous(), self.group)  # chunk j: this rank's tokens, rank j's heads
        if descales is not None:
            got = (got.view(torch.float8_e4m3fn).float() * descales[2]).to(q.dtype)
        return got.permute(1, 2, 0, 3, 4).reshape(b, s_local, heads * dh)

    def shard_forward(self, image: torch.Tensor, text: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      selector: torch.Tensor | None, text_lens: tuple[int, ...]):
        """This rank's part of one forward's inputs: image and text tokens padded to multiples of P and sliced.

        Args:
            image: (B, S_img, D) image tokens; text: (B, L, D) text tokens (right-padded to L).
            cos, sin: (S_img + L_p, Dh / 2) RoPE tables for the text padded to ``L_p = padded_length(L, P)``.
            selector: None or zero_cond_t's (1, S_img, 1) bool.
            text_lens: valid text tokens per sample.

        Returns:
            ``(image, text, cos, sin, selector, image_valid)``: (B, S_img_p / P, D), (B, L_p / P, D), this rank's
            table rows (image rows, then text rows), its selector slice, and the (S_img, 0) size carrier. Padded
            image tokens get zero RoPE rows and ``False`` selector entries; nothing reads their outputs.
        """
        p = self.degree
        s_img, length = image.shape[1], text.shape[1]
        img_pad, txt_pad = padded_length(s_img, p) - s_img, padded_length(length, p) - length
        if cos.shape[0] != s_img + length + txt_pad:
            raise ValueError(f"RoPE tables have {cos.shape[0]} rows, expected {s_img + length + txt_pad}")
        image = F.pad(image, (0, 0, 0, img_pad))
        text = F.pad(text, (0, 0, 0, txt_pad))
        tables = []
        for table in (cos, sin):
            img_rows = self.local(F.pad(table[:s_img], (0, 0, 0, img_pad)), 0)
            tables.append(torch.cat([img_rows, self.local(table[s_img:], 0)]).contiguous())
        if selector is not None:
            selector = self.local(F.pad(selector, (0, 0, 0, img_pad), value=False), 1).contiguous()
        valid = torch.empty((s_img, 0), device=image.device)
        return (self.local(image, 1).contiguous(), self.local(text, 1).contiguous(), tables[0], tables[1], selector,
                valid)


def _quantized_joint_attention(qkv8: torch.Tensor, descales: torch.Tensor, image_tokens: int,
                               txt_lens: tuple[torch.Tensor, ...], emulate: bool) -> torch.Tensor:
    """``fast.block.joint_attention`` on e4m3 codes: qkv8 (3, B, H, S, Dh) e4m3, descales (3, 1, 1, 1, 1) float32
    -> (B, S, H * Dh) e4m3 codes as uint8 in units of v's descale; per sample over its first ``image_tokens`` +
    its text tokens (``txt_lens``' size carriers), padded query rows zero."""
    q_scale, k_scale, v_scale = (d.reshape(1, 1, 1, 1) for d in descales)

    def attend(i: int, valid: int) -> torch.Tensor:
        q8, k8, v8 = (qkv8[j, i:i + 1, :, :valid].contiguous() for j in range(3))
        return attention_quantized(q8, k8, v8, q_scale, k_scale, v_scale, emulate).view(torch.uint8)

    return per_sample_attention(attend, image_tokens, txt_lens, qkv8.shape[3])
