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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F  # noqa: N812

__all__ = ["SequenceShards", "padded_length"]


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
                  traced: bool = False) -> torch.Tensor:
        """Joint attention of the whole sequence from this rank's shard (arguments: :meth:`_attention`); ``traced``:
        the section and its functional all-to-alls run where they are called (traced into a compiled block), else
        eagerly outside any graph."""
        if traced:
            return self._attention(q, k, v, image_tokens, image_valid, txt_lens, backend, _traced_all_to_all)
        return self._eager_attention(q, k, v, image_tokens, image_valid, txt_lens, backend, _all_to_all)

    @torch.compiler.disable
    def _eager_attention(self, *args) -> torch.Tensor:
        return self._attention(*args)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image_tokens: int,
                   image_valid: torch.Tensor, txt_lens: tuple[torch.Tensor, ...], backend: str,
                   exchange: Callable[[torch.Tensor, object], torch.Tensor]) -> torch.Tensor:
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

        Returns:
            (B, s_img + s_txt, H * Dh): this rank's rows of the attention output, all heads.
        """
        from ..fast.block import joint_attention

        p = self.degree
        b, s_local, heads, dh = q.shape
        if heads % p:
            raise ValueError(f"{heads} attention heads do not divide by the sequence-parallel degree {p}")
        hp, valid = heads // p, image_valid.shape[0]
        send = torch.stack([q, k, v]).view(3, b, s_local, p, hp, dh).permute(3, 0, 1, 2, 4, 5)  # (P, 3, B, s, H/P, Dh)
        got = exchange(send.contiguous(), self.group)  # chunk j: rank j's tokens, this rank's heads
        img = got[:, :, :, :image_tokens].permute(1, 2, 0, 3, 4, 5).reshape(3, b, p * image_tokens, hp, dh)
        txt = got[:, :, :, image_tokens:].permute(1, 2, 0, 3, 4, 5).reshape(3, b, p * (s_local - image_tokens), hp,
                                                                              dh)
        # Valid image tokens, text, then the image padding: valid keys first, as joint_attention wants them.
        joint = torch.cat([img[:, :, :valid], txt, img[:, :, valid:]], dim=2).transpose(2, 3)  # (3, B, H/P, S, Dh)
        out = joint_attention(joint[0], joint[1], joint[2], valid, txt_lens, None, backend).view(b, -1, hp, dh)
        text_total = txt.shape[2]
        img_out = torch.cat([out[:, :valid], out[:, valid + text_total:]], dim=1).view(b, p, image_tokens, hp, dh)
        txt_out = out[:, valid: valid + text_total].reshape(b, p, s_local - image_tokens, hp, dh)
        back = torch.cat([img_out, txt_out], dim=2).permute(1, 0, 2, 3, 4)  # (P, B, s, H/P, Dh): chunk j to rank j
        got = exchange(back.contiguous(), self.group)  # chunk j: this rank's tokens, rank j's heads
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
