"""Arguments of DeepSpeed's op optimizers that have no torch counterpart."""
from __future__ import annotations


def refuse_no_bias_correction(name: str, bias_correction: bool) -> None:
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False) is not supported: torch's Adam always bias-corrects; "
                         "drop the argument (DeepSpeed's default is True)")
