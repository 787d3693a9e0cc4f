"""Mixture of Experts with expert parallelism, at DeepSpeed's paths: `moe.layer.MoE`,
`moe.sharded_moe` (TopKGate, MOELayer, top1gating / top2gating / topkgating), `moe.experts.Experts`,
`moe.utils` (param-group helpers), and AutoEP for transformers MoE models (`moe.autoep.apply_autoep`). See
docs/moe.md."""

from zerospeed.moe.autoep import apply_autoep
from zerospeed.moe.experts import Experts
from zerospeed.moe.layer import MoE, bind_expert_groups
from zerospeed.moe.sharded_moe import MOELayer, TopKGate

__all__ = ["Experts", "MOELayer", "MoE", "TopKGate", "apply_autoep", "bind_expert_groups"]
