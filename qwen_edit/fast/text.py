"""Text lengths and prompt batching for the fast forward.

Prompts in one batch are right-padded to the longest: sample ``i`` has ``lens[i]`` valid text
tokens followed by padding, and ``prompt_emb_mask[i] == [1] * lens[i] + [0] * (L - lens[i])``.
Padded text tokens are never attended to (they are dropped from the keys) and their outputs are
discarded; the text stream itself is never returned.

Reading the lengths off a CUDA mask is a host sync. :func:`text_lengths` does it once per mask
tensor (remembered by identity), and :func:`batch_prompts` returns them so a sampler can pass
``txt_seq_lens`` and never sync.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

_KNOWN: OrderedDict[int, tuple[weakref.ref, tuple[int, ...]]] = OrderedDict()
_KNOWN_ENTRIES = 32


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

    One device-to-host copy per mask tensor: the answer is remembered for as long as the tensor
    lives (a mask changed in place after its first use is not re-read; pass ``txt_seq_lens`` to
    :func:`~..fast_forward.fast_model_fn` to be explicit). Raises ValueError for a mask that is not
    right-padded.
    """
    if mask.dim() != 2:
        raise ValueError(f"prompt_emb_mask must be (B, L), got shape {tuple(mask.shape)}")
    entry = _KNOWN.get(id(mask))
    if entry is not None and entry[0]() is mask:
        _KNOWN.move_to_end(id(mask))
        return entry[1]
    lens = _lengths_from_mask(mask)
    _remember(mask, lens)
    return lens


def _remember(mask: torch.Tensor, lens: tuple[int, ...]) -> None:
    _KNOWN[id(mask)] = (weakref.ref(mask), lens)
    while len(_KNOWN) > _KNOWN_ENTRIES:
        _KNOWN.popitem(last=False)


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
    _remember(mask, tuple(lens))
    return {"prompt_emb": emb, "prompt_emb_mask": mask, "txt_seq_lens": tuple(lens)}
