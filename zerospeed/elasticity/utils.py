"""DeepSpeed's ``deepspeed.elasticity.utils``."""

from __future__ import annotations


def is_torch_elastic_compatible() -> bool:
    """True: torch's elastic agent (torch >= 1.11) is always there, as zerospeed needs torch >= 2.4."""
    return True
