"""The error every checkpoint reader raises: the file, what is wrong with it, and what to do."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint file is missing, malformed, of the wrong kind or inconsistent.

    The message always names the file and says what to do about it:
    ``"<file name> <problem> <remedy> (full path: <path>)"``, so ``problem`` is
    phrased as a predicate ("is truncated: ...", "was chosen as ...").

    Attributes:
        path: the file (or folder / index file) at fault.
        problem: what is wrong, one sentence.
        remedy: what the user should do.
    """

    def __init__(self, path: Path | str, problem: str, remedy: str):
        self.path = Path(path)
        self.problem = problem.rstrip()
        self.remedy = remedy.rstrip()
        super().__init__(f"{self.path.name} {self.problem} {self.remedy} (full path: {self.path})")
