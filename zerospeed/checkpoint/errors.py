"""The checkpoint error, and how a failure on one rank becomes the same error on every rank."""

from __future__ import annotations

from zerospeed import comm


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file, tag or parameters."""


class CheckpointTagError(CheckpointError, AssertionError):
    """The ranks passed different checkpoint tags under `checkpoint.tag_validation: FAIL`; DeepSpeed asserts
    there, so this is an AssertionError too (Note [errors catchable as DeepSpeed's], utils/errors.py)."""


def raise_if_any_rank_failed(local_error: str | None) -> None:
    """Collective: if any rank reports an error, raise it on every rank.

    A rank that raised alone would leave the others waiting in the next collective until the
    timeout; exchanging the outcome first makes every rank fail at once with the same message.
    """
    errors = [(r, e) for r, e in enumerate(comm.all_gather_object(local_error)) if e]
    if not errors:
        return
    if len({e for _, e in errors}) == 1:
        raise CheckpointError(errors[0][1])
    raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in errors))
