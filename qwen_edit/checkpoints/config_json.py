"""A diffusers ``config.json`` must agree with the weights beside it.

The loader builds every model at the size its tensors give. Where a config file states a size too
(``num_layers``, ``hidden_size``...), the two must agree: a config saying 60 layers beside weights
holding fewer means an incomplete download or files from two models, and is refused rather than run
as a smaller model.

Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .safetensors_io import CheckpointError

MISMATCH_REMEDY = (
    "The weights are incomplete or the config belongs to another model: download the whole folder again "
    "(config.json and weights from one download)."
)


def _plain(value: Any) -> Any:
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


def check_config_agrees(
    declared: Mapping[str, Any],
    weights: Mapping[str, Any],
    *,
    config_name: str,
    source: Path,
) -> None:
    """Refuse every field of ``weights`` that ``declared`` states differently.

    Args:
        declared: the config file's values (a field absent or None is not checked).
        weights: field -> the value the tensors give, under the config's field names.
        config_name: the config file as users see it, e.g. ``"transformer/config.json"``.
        source: the weights (file or folder) named in the error.

    Raises:
        CheckpointError: listing each disagreeing field with both values.
    """
    wrong = [
        f"{field} is {declared[field]} there but {value} in the weights"
        for field, value in weights.items()
        if declared.get(field) is not None and _plain(declared[field]) != _plain(value)
    ]
    if wrong:
        raise CheckpointError(source, f"disagrees with {config_name}: {'; '.join(wrong)}.", MISMATCH_REMEDY)
