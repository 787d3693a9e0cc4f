"""Knowledge distillation for the compression library: the logit loss that trains a compressed student
against its teacher (layer reduction, XTC), and ZeroQuant's layer-by-layer distillation (LKD).

DeepSpeed leaves both to its examples; here they are library functions, so the recipes in
docs/compression.md and ``benchmarks/compression.py`` are a few lines each.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Hinton's soft-target loss: ``T**2 * KL(softmax(teacher / T) || softmax(student / T))``, the
    mean over every position (all dimensions but the last, the classes)."""
    t = temperature
    log_p_student = F.log_softmax(student_logits.float() / t, dim=-1)
    p_teacher = F.softmax(teacher_logits.detach().float() / t, dim=-1)
    kl = (p_teacher * (torch.log(p_teacher.clamp_min(1e-30)) - log_p_student)).sum(dim=-1)
    return kl.mean() * t * t


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _layer_io(teacher: nn.Module, layer: nn.Module, batch) -> tuple[tuple, dict, torch.Tensor]:
    """The positional args, keyword args and output of ``layer`` when ``teacher`` runs on ``batch``."""
    seen: dict = {}

    def hook(module, args, kwargs, output):
        seen.update(
            args=tuple(a.detach() if torch.is_tensor(a) else a for a in args),
            kwargs=kwargs,
            output=_first(output).detach(),
        )

    handle = layer.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            teacher(*batch) if isinstance(batch, (tuple, list)) else teacher(batch)
    finally:
        handle.remove()
    if not seen:
        raise RuntimeError("layerwise_distill: the teacher's forward never ran the layer being distilled")
    return seen["args"], seen["kwargs"], seen["output"]


def layerwise_distill(
    student: nn.Module,
    teacher: nn.Module,
    module_name_prefix: str,
    batches: Iterable,
    steps_per_layer: int,
    lr: float = 1e-4,
) -> list[float]:
    """ZeroQuant's layer-by-layer knowledge distillation (arXiv 2206.01861, section 4.3).

    For each layer ``k`` of ``student.<module_name_prefix>`` in order: run the (unquantized) teacher
    on a batch, take the input its layer ``k`` received and the output it produced, and train only
    the student's layer ``k`` (e.g. its quantized Linears) to map that same input to that output
    (mean squared error, Adam, ``steps_per_layer`` steps cycling over ``batches``). The teacher's
    own hidden states feed every layer, so the layers are independent and need no labels.

    Returns the final MSE of each layer.
    """
    s_layers = student.get_submodule(module_name_prefix)
    t_layers = teacher.get_submodule(module_name_prefix)
    if len(s_layers) != len(t_layers):
        raise ValueError(
            f"layerwise_distill: {module_name_prefix} has {len(s_layers)} student layers and "
            f"{len(t_layers)} teacher layers; LKD pairs them one to one"
        )
    batches = list(batches)
    if not batches:
        raise ValueError("layerwise_distill: batches is empty")
    teacher.eval()
    final: list[float] = []
    for s_layer, t_layer in zip(s_layers, t_layers):
        params = [p for p in s_layer.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=lr)
        loss = torch.zeros(())
        for step in range(steps_per_layer):
            args, kwargs, target = _layer_io(teacher, t_layer, batches[step % len(batches)])
            loss = F.mse_loss(_first(s_layer(*args, **kwargs)).float(), target.float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        final.append(loss.item())
    return final
