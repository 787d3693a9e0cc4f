"""`MoE`: DeepSpeed's Mixture-of-Experts layer (`deepspeed.moe.layer.MoE`), and how it gets its groups.

Note [expert groups at initialize]: a DeepSpeed user builds `MoE(...)` before `initialize`, when no
parallel layout is known yet; DeepSpeed's engine then gives every MoE layer its expert-parallel
group. zerospeed does the same from the one mesh the engine trains over: `zerospeed.initialize`
calls `bind_expert_groups(model, mesh)`, which asks the mesh for each layer's `ep_size` split
(`mesh.expert_axes`, collective: every rank walks the same modules in the same order). A layer with
ep_size 1 needs no group and runs without initialize; one with ep_size > 1 that was never bound says
so at its first forward. `moe.bind_mesh(mesh)` binds one layer by hand.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from zerospeed import comm
from zerospeed.checkpoint.protocols import ExpertShare
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.moe.experts import Experts
from zerospeed.moe.sharded_moe import MOELayer, TopKGate
from zerospeed.utils.logging import log_dist


class MoE(nn.Module):
    """A Mixture-of-Experts layer: `num_experts` copies of `expert`, `num_experts / ep_size` on each
    rank, a top-k gate, and (with `use_residual`) PR-MoE's residual: a dense copy of `expert` mixed
    in with learnt per-token coefficients. forward(hidden_states) -> (output, l_aux, exp_counts).

    Arguments as DeepSpeed's (same names and defaults); `use_tutel` is accepted and ignored (no Tutel
    kernels here), `enable_expert_tensor_parallelism` is refused when the mesh has tensor parallelism.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"MoE: num_experts={num_experts} is not divisible by ep_size={ep_size}; every "
                "expert-parallel rank holds num_experts / ep_size experts"
            )
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        log_dist(
            f"MoE layer: {num_experts} experts, {self.num_local_experts} per rank, expert parallel size {ep_size}",
            ranks=[0],
        )
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
        )
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts, use_tutel=use_tutel
        )
        self.expert_data_parallel_group = comm.SELF  # set with the expert-parallel group (bind_mesh)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)  # per token: weight of the MoE and of the dense path

    # -- groups (Note [expert groups at initialize]) ------------------------------------------------
    def bind_mesh(self, mesh) -> None:
        """Take this layer's expert-parallel group (size ep_size) from `mesh` (collective)."""
        if mesh.size("tp") > 1:
            raise NotImplementedError(
                f"MoE with tensor parallelism (tp={mesh.size('tp')}) is not supported yet: "
                "tokens are replicated over tensor-parallel ranks; use tp=1"
            )
        ep_axis, edp_axis = mesh.expert_axes(self.ep_size)  # Note [expert parallel layout] (sharded_moe.py)
        self.deepspeed_moe._set_ep_group(ep_axis.handle)
        self.expert_data_parallel_group = edp_axis.handle  # which replica writes an expert's checkpoint file

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's hook: groups over plain data parallelism of the whole world (a new mesh; collective).
        Under zerospeed.initialize this is done for you, from the engine's mesh."""
        if use_data_before_expert_parallel_:
            raise NotImplementedError(
                "use_data_before_expert_parallel_=True (the data-major expert layout) is not "
                "supported; zerospeed uses DeepSpeed's default expert layout"
            )
        self.bind_mesh(ParallelMesh.data_parallel())

    # -- checkpoints (the checkpoint's `HoldsExperts` protocol) ---------------------------------------
    def checkpoint_experts(self) -> ExpertShare:
        """This rank's experts as checkpoints name them (Note [global expert names] in checkpoint/experts.py):
        global expert `ep_rank * num_local_experts + j` is local expert j."""
        return ExpertShare(
            first=comm.get_rank(self.deepspeed_moe.ep_group) * self.num_local_experts,
            local=self.num_local_experts,
            writer=comm.get_rank(self.expert_data_parallel_group) == 0,
            experts="deepspeed_moe.experts.deepspeed_experts",
        )

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """(output, l_aux, exp_counts): the layer's output, the gate's load-balancing loss, the number
        of tokens each expert was routed (before capacity dropped any), on this rank."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def bind_expert_groups(model: nn.Module, mesh) -> int:
    """Give every MoE layer of `model` its expert-parallel group from `mesh`; the number of layers.
    Collective when a layer's ep_size needs new groups (Note [expert groups at initialize])."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.bind_mesh(mesh)
    return len(layers)


def moe_monitor_events(model: nn.Module) -> list[tuple[str, float]]:
    """Monitor scalars of the last forward of every MoE layer, on this rank: its aux loss and the tokens
    routed to each expert ("Train/MoE/layer_{i}/l_aux", ".../expert_{e}_tokens"); the observer writes
    them with the other per-step events."""
    events = []
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, MoE)):
        moe = layer.deepspeed_moe
        if moe.l_aux is None:
            continue
        events.append((f"Train/MoE/layer_{i}/l_aux", float(moe.l_aux.detach())))
        events += [(f"Train/MoE/layer_{i}/expert_{e}_tokens", float(n)) for e, n in enumerate(moe.exp_counts.tolist())]
    return events
