"""Text lengths and prompt batching for the fast forward.

Prompts in one batch are right-padded to the longest: sample ``i`` has ``lens[i]`` valid text
tokens followed by padding, and ``prompt_emb_mask[i] == [1] * lens[i] + [0] * (L - lens[i])``.
Padded text tokens are never attended to (they are dropped from the keys) and their outputs are
discarded; the text stream itself is never returned.

Reading the lengths off a CUDA mask is a host sync. :func:`batch_prompts` returns them so a sampler can pass
``txt_seq_lens`` and never sync; :meth:`.prepared.PreparedDit.text_lengths` reads them once per mask tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def _lengths_from_mask(mask: torch.Tensor) -> tuple[int, ...]:
    valid = mask.detach().to("cpu") != 0
    lens = valid.sum(dim=1)
    for i, n in enumerate(lens.tolist()):
        if not bool(valid[i, :n].all()) or bool(valid[i, n:].any()):
            raise ValueError(
                f"prompt_emb_mask row {i} is not right-padded ([1] * n + [0] * rest); the fast forward needs "
                "valid text tokens first (pad prompts with batch_prompts)"
            )
    return tuple(int(n) for n in lens.tolist())


def text_lengths(mask: torch.Tensor) -> tuple[int, ...]:
    """Valid text tokens per sample of a right-padded ``prompt_emb_mask`` (B, L) of 0/1 (any int/bool dtype).

    One device-to-host copy (a host sync for a CUDA mask). Raises ValueError for a mask that is not right-padded.
    """
    if mask.dim() != 2:
        raise ValueError(f"prompt_emb_mask must be (B, L), got shape {tuple(mask.shape)}")
    return _lengths_from_mask(mask)


def batch_prompts(conditions: Sequence[Mapping[str, torch.Tensor]]) -> dict:
    """Stack per-prompt conditioning into one batch (e.g. ``[positive, negative]`` for batched true CFG).

    Args:
        conditions: each ``{"prompt_emb": (1, L_i, T), "prompt_emb_mask": (1, L_i)}`` as DiffSynth's
            prompt embedder returns them (a mask may carry right padding of its own).

    Returns:
        ``{"prompt_emb": (B, L, T), "prompt_emb_mask": (B, L) long, "txt_seq_lens": tuple[int, ...]}``
        with ``L = max(L_i)``, zero padding on the right; splat it into ``fast_model_fn``. The lengths
        are read once here (one host sync per call of this function, not per forward).
    """
    if not conditions:
        raise ValueError("batch_prompts needs at least one conditioning")
    embs, lens = [], []
    for i, cond in enumerate(conditions):
        emb, mask = cond["prompt_emb"], cond["prompt_emb_mask"]
        if emb.dim() != 3 or emb.shape[0] != 1 or mask.shape != emb.shape[:2]:
            raise ValueError(
                f"conditioning {i}: expected prompt_emb (1, L, T) and prompt_emb_mask (1, L), got "
                f"{tuple(emb.shape)} and {tuple(mask.shape)}"
            )
        (n,) = text_lengths(mask)
        embs.append(emb[:, :n])
        lens.append(n)
    longest = max(lens)
    emb = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e in embs], dim=0)
    positions = torch.arange(longest, device=emb.device)
    mask = (positions[None, :] < torch.tensor(lens, device=emb.device)[:, None]).long()
    return {"prompt_emb": emb, "prompt_emb_mask": mask, "txt_seq_lens": tuple(lens)}
