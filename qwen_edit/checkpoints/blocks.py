"""The numbered blocks of a checkpoint: all present from 0, each complete, as many as the model has.

A checkpoint missing whole blocks still has a consistent shape for every tensor it holds, so a model
built at "the size its tensors give" would silently run smaller. These checks read tensor names only
(headers, no tensor data):

* :func:`check_blocks`: block indices ``<prefix>.<i>.`` contiguous from 0, and every block with the
  full key set (the union over all blocks: blocks of one stack are built alike);
* :func:`check_block_count`: the count agrees with a config file's or the released model's number.

Pure Python: no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from .safetensors_io import CheckpointError

_SHOW = 5
_BLOCKS_SHOWN = 3

INCOMPLETE_REMEDY = "The file is incomplete (a partial download or a broken merge); download it again."


def _sample(items: Iterable[object]) -> str:
    items = list(items)
    shown = ", ".join(repr(i) if isinstance(i, str) else str(i) for i in items[:_SHOW])
    return shown + (f" and {len(items) - _SHOW} more" if len(items) > _SHOW else "")


def block_keys(keys: Iterable[str], prefix: str) -> dict[int, set[str]]:
    """Block index -> the key suffixes of that block, for keys ``<prefix>.<index>.<suffix>``."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.+)$")
    blocks: dict[int, set[str]] = {}
    for key in keys:
        match = pattern.match(key)
        if match:
            blocks.setdefault(int(match.group(1)), set()).add(match.group(2))
    return blocks


def check_blocks(keys: Iterable[str], *, prefix: str, what: str, source: Path) -> int:
    """Check the blocks ``<prefix>.<i>.*`` of a checkpoint and return how many there are.

    Args:
        keys: tensor names (one naming scheme, quantization scales left out).
        prefix: the block stack, e.g. ``"transformer_blocks"``.
        what: what one block is called in messages, e.g. ``"transformer block"``.
        source: the file (or folder) named in errors.

    Raises:
        CheckpointError: indices with gaps (naming the missing ones), or blocks that lack keys other
            blocks have (naming the blocks and the keys).
    """
    blocks = block_keys(keys, prefix)
    if not blocks:
        return 0
    last = max(blocks)
    missing = sorted(set(range(last + 1)) - set(blocks))
    if missing:
        raise CheckpointError(
            source,
            f"lacks {what}s {_sample(missing)}: it holds {len(blocks)} {what}s numbered 0 to {last}, with gaps.",
            INCOMPLETE_REMEDY,
        )
    full = set().union(*blocks.values())
    incomplete = {i: sorted(full - found) for i, found in sorted(blocks.items()) if found != full}
    if incomplete:
        shown = "; ".join(
            f"{what} {i} lacks {len(lacking)} of its {len(full)} tensors ({_sample(lacking)})"
            for i, lacking in list(incomplete.items())[:_BLOCKS_SHOWN]
        )
        more = f"; and {len(incomplete) - _BLOCKS_SHOWN} more incomplete {what}s" if len(incomplete) > 3 else ""
        raise CheckpointError(source, f"has incomplete {what}s: {shown}{more}.", INCOMPLETE_REMEDY)
    return len(blocks)


def check_block_count(found: int, expected: int, *, what: str, said_by: str, source: Path, remedy: str) -> None:
    """Refuse a block count other than the one a config or the released model gives.

    Args:
        found: blocks the weights hold.
        expected: blocks ``said_by`` says.
        what: what one block is called, e.g. ``"transformer block"``.
        said_by: where ``expected`` comes from, e.g. ``"transformer/config.json (num_layers)"``.

    Raises:
        CheckpointError: naming both numbers.
    """
    if found != expected:
        raise CheckpointError(source, f"holds {found} {what}s, but {said_by} says {expected}.", remedy)
