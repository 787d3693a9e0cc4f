"""Tag resolution: `latest`, and checking that every rank names the same tag (checkpoint.tag_validation)."""

from __future__ import annotations

import logging
from pathlib import Path

from zerospeed import comm
from zerospeed.checkpoint.errors import CheckpointError, CheckpointTagError
from zerospeed.checkpoint.naming import LATEST, CheckpointPaths, check_tag

logger = logging.getLogger(__name__)


def tag_disagreement(tags: list[str]) -> str | None:
    """None when all ranks' tags are equal, else a message listing which rank has which."""
    if len(set(tags)) <= 1:
        return None
    by_tag: dict[str, list[int]] = {}
    for rank, tag in enumerate(tags):
        by_tag.setdefault(tag, []).append(rank)
    return "checkpoint tags differ across ranks: " + "; ".join(f"{t!r} on ranks {r}" for t, r in by_tag.items())


def agree_on_tag(tag: str, validation: str) -> str:
    """Collective: rank 0's tag, after checking every rank passed the same one.

    validation (checkpoint.tag_validation): "FAIL" raises on a mismatch, "WARN" logs it, "IGNORE"
    stays silent; a run always uses rank 0's tag so that all ranks write into one directory.
    """
    tags = comm.all_gather_object(tag)
    problem = tag_disagreement(tags)
    if problem is not None:
        if validation.upper() == "FAIL":
            raise CheckpointTagError(problem + " (checkpoint.tag_validation is FAIL)")
        if validation.upper() == "WARN":
            logger.warning("%s; using rank 0's tag %r", problem, tags[0])
    return check_tag(tags[0])


def read_latest(root: Path) -> str | None:
    """The tag named by `root/latest`, or None when there is no such file."""
    path = Path(root) / LATEST
    if not path.is_file():
        return None
    return path.read_text().strip()


def resolve_tag_dir(paths: CheckpointPaths) -> Path:
    """The directory holding tag `paths.tag`: normally `{root}/{tag}`; after a save that crashed
    between its two renames, the complete previous copy (Note [tag directory swap])."""
    if paths.dir.is_dir():
        return paths.dir
    if paths.previous.is_dir():
        logger.warning(
            "checkpoint %s is missing but %s holds its previous complete copy (a save of this tag "
            "was interrupted); loading that",
            paths.dir,
            paths.previous,
        )
        return paths.previous
    raise CheckpointError(f"checkpoint directory {paths.dir} does not exist")
