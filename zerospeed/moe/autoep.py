"""AutoEP: expert parallelism for transformers MoE models by config alone (DeepSpeed's
`"expert_parallel": {"enabled": true, "autoep_size": N, ...}`).

`zerospeed.initialize` calls `apply_autoep_config` when the config enables it; `apply_autoep(model,
mesh, ep_size)` does the same by hand. Each sparse-MoE block of a transformers 5 model (Mixtral,
Qwen2-MoE, Qwen3-MoE, ...: a block with a router child `gate` and a fused expert container `experts`
holding `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`) gets its expert container replaced by an
`ExpertParallelExperts` holding this rank's `E / ep` experts.

Note [AutoEP keeps the model's router]: DeepSpeed swaps the whole block for its own layer and
re-implements each family's routing (softmax or sigmoid scores, top-k, renormalisation, scaling).
Here only the expert container is swapped: the block's own forward still runs the router (so the
routing math is transformers' by construction: Mixtral's softmax -> top-k -> renormalised weights),
its input jitter, and its shared experts (Qwen2-MoE), and the router's logits are still what
`output_router_logits` records for the aux loss, which transformers computes from each rank's own
tokens exactly as a plain data-parallel replica would. The config's routing overrides can therefore
only restate what the model does; a value that would change it is a ConfigError.

Note [AutoEP dispatch]: routing is dropless (every (token, choice) pair reaches its expert). The
pairs are sorted by global expert (stable), so the rows for expert-parallel rank j (experts
j*E/ep .. (j+1)*E/ep - 1, Note [expert parallel layout] in sharded_moe.py) are one contiguous run;
counts travel first (`dropless.exchange_counts`), then the rows by an uneven all-to-all, the local
experts run on their rows, the outputs come back by the conjugate all-to-all, are scaled by the
routing weights on the token's own rank and summed per token — the same sum transformers' experts
forms. Every rank of an expert-parallel group must run the same number of forwards (the exchange
is collective), as with any expert parallelism. Expert parameters are tagged as expert parameters
of group "ep_size_N" made by AutoEP (Note [expert parameter tags], experts.py), so the engine
reduces them over their expert-data-parallel ranks, and their gradients are scaled by 1/ep
(Note [expert gradient scale]).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from zerospeed import comm
from zerospeed.checkpoint.export import export_state_dict
from zerospeed.checkpoint.protocols import ExpertShare
from zerospeed.comm.functional import all_to_all
from zerospeed.moe.dropless import exchange_counts
from zerospeed.moe.sharded_moe import _ScaleGrad
from zerospeed.optim.param_groups import substitute_parameters
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import log_dist
from zerospeed.zero import GatheredParameters, tags

# DeepSpeed's preset names. A preset fixes where the blocks are and which model.config attribute
# counts the experts. Run against stock transformers (tests/dist/test_moe_autoep_parity.py): mixtral and
# qwen3_moe by preset, qwen2_moe (no DeepSpeed preset) by the structural detection of find_moe_blocks.
PRESETS: dict[str, dict] = {
    "mixtral": {
        "moe_layer_pattern": r"model\.layers\.\d+\.mlp",
        "num_experts_attr": "num_local_experts",
        "model_types": ("mixtral",),
    },
    "qwen3_moe": {
        "moe_layer_pattern": r"model\.layers\.\d+\.mlp",
        "num_experts_attr": "num_experts",
        "model_types": ("qwen3_moe",),
    },
}
UNSUPPORTED_PRESETS = ("qwen3_5_moe", "deepseek_v2", "deepseek_v3", "llama4")


@dataclass(frozen=True)
class AutoEPSpec:
    """What to look for: block names (regex, full match; None = any), child and weight names."""

    moe_layer_pattern: str | None = None
    router: str = "gate"
    experts: str = "experts"
    w1: str = "gate_up_proj"
    w2: str = "down_proj"


# -- pure helpers --------------------------------------------------------------------------------------


def local_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global experts expert-parallel rank `ep_rank` holds (Note [expert parallel layout])."""
    if ep_size < 1 or num_experts % ep_size:
        raise ConfigError(
            f"expert_parallel.autoep_size={ep_size} does not divide the model's {num_experts} experts; "
            "every expert-parallel rank holds num_experts / autoep_size of them"
        )
    local = num_experts // ep_size
    return range(ep_rank * local, (ep_rank + 1) * local)


@dataclass(frozen=True)
class DispatchPlan:
    """Note [AutoEP dispatch] for one forward: the (token, choice) pairs sorted by expert."""

    token_N: torch.Tensor  # token of each sorted pair
    choice_N: torch.Tensor  # flat index (token * k + slot) of each sorted pair into the routing weights
    counts_E: torch.Tensor  # pairs per global expert (int64)
    send_rows: list[int]  # pairs to each expert-parallel rank


def plan_dispatch(top_k_index_SK: torch.Tensor, num_experts: int, ep_size: int) -> DispatchPlan:
    """Pure: sort the routed pairs by global expert. Indices outside [0, E) (a router's "no expert"
    marker, which transformers' experts skip) are dropped."""
    flat = top_k_index_SK.reshape(-1)
    k = top_k_index_SK.shape[-1] if top_k_index_SK.dim() > 1 else 1
    valid = torch.nonzero((flat >= 0) & (flat < num_experts)).flatten()
    order = valid[torch.argsort(flat[valid], stable=True)]
    counts = torch.bincount(flat[valid], minlength=num_experts).to(torch.int64)
    send = counts.reshape(ep_size, -1).sum(dim=1).tolist()
    return DispatchPlan(order // k, order, counts, send)


# config key each routing fact is asserted by
_FACT_KEYS = {
    "score_func": "score_func",
    "score_apply": "score_apply",
    "top_k": "top_k",
    "route_norm": "route_norm",
    "num_experts": "num_experts_attr",
}


_SOFTMAX_ROUTERS = ("Mixtral", "Qwen2Moe", "Qwen3Moe")  # router class name prefixes whose facts are known


def routing_facts(router: nn.Module, num_experts: int) -> dict:
    """What the model's own router does (Note [AutoEP keeps the model's router]): the Mixtral and
    Qwen-MoE routers score by softmax and weight the experts' outputs (post); Mixtral always
    renormalises the top-k weights, Qwen-MoE when `norm_topk_prob`. For another router only its
    `top_k` and the expert count are known (None: a config value for it cannot be checked)."""
    known = type(router).__name__.startswith(_SOFTMAX_ROUTERS)
    return {
        "score_func": "softmax" if known else None,
        "score_apply": "post" if known else None,
        "top_k": getattr(router, "top_k", None),
        "route_norm": bool(getattr(router, "norm_topk_prob", True)) if known else None,
        "num_experts": num_experts,
    }


# -- the expert-parallel container ---------------------------------------------------------------------


class ExpertParallelExperts(nn.Module):
    """This rank's `E / ep` experts of one sparse-MoE block, with transformers' fused layout and the
    replaced container's parameter names (`gate_up_proj [E/ep, 2I, H]`, `down_proj [E/ep, H, I]` by
    default) and call signature:
    forward(hidden_states [S, H], top_k_index [S, k], top_k_weights [S, k]) -> [S, H]."""

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        act_fn,
        num_experts: int,
        ep_size: int,
        ep_rank: int,
        ep_group,
        names: tuple[str, str] = ("gate_up_proj", "down_proj"),
        expert_data_parallel_group=None,
    ):
        super().__init__()
        self.param_names = names
        span = local_expert_range(num_experts, ep_size, ep_rank)
        self.num_experts, self.ep_size, self.ep_rank = num_experts, ep_size, ep_rank
        self.first_expert, self.num_local_experts = span.start, len(span)
        self.ep_group = ep_group
        # the replicas of these experts: which one writes their checkpoint files (checkpoint/experts.py)
        self.expert_data_parallel_group = (
            expert_data_parallel_group if expert_data_parallel_group is not None else comm.SELF
        )
        self.expert_group_name = f"ep_size_{ep_size}"
        self.act_fn = act_fn
        for name, full in zip(names, (gate_up_proj, down_proj)):  # copies: the full tensors go with the old container
            self.register_parameter(
                name, nn.Parameter(full[span.start : span.stop].detach().clone(), requires_grad=full.requires_grad)
            )
        self._tag()

    @property
    def w_in(self) -> nn.Parameter:
        """The fused gate + up projection [E/ep, 2I, H], whatever the model calls it."""
        return self._parameters[self.param_names[0]]

    @property
    def w_out(self) -> nn.Parameter:
        """The down projection [E/ep, H, I]."""
        return self._parameters[self.param_names[1]]

    def _tag(self) -> None:  # Note [expert parameter tags] (experts.py)
        for p in (self.w_in, self.w_out):
            tags.mark_expert(p, self.expert_group_name, autoep=True)

    def __setstate__(self, state) -> None:  # deepcopy / unpickle: the copies are expert parameters too
        super().__setstate__(state)
        self._tag()

    def extra_repr(self) -> str:
        return (
            f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} of "
            f"{self.num_experts}, ep_size={self.ep_size}"
        )

    # -- checkpoints (the checkpoint's `HoldsExperts` and `SplitParameters` protocols) -----------------
    def checkpoint_experts(self) -> ExpertShare:
        """Note [stacked expert checkpoints] (checkpoint/experts.py): rows first_expert.. of the whole tensors."""
        return ExpertShare(
            first=self.first_expert,
            local=self.num_local_experts,
            writer=comm.get_rank(self.expert_data_parallel_group) == 0,
            stacked=tuple(self.param_names),
            total=self.num_experts,
        )

    def full_parameter(self, name: str) -> torch.Tensor | None:
        """Collective over the expert-parallel group: stacked parameter `name` with every expert's rows (None
        when this rank holds them all, or for a parameter that is not stacked)."""
        if name not in self.param_names or self.ep_size == 1:
            return None
        return self.all_experts(self._parameters[name])

    def all_experts(self, local: torch.Tensor) -> torch.Tensor:
        """Collective over the expert-parallel group: the [E, ...] tensor of every rank's [E/ep, ...] `local`
        (an all-gather; ep rank order is expert order)."""
        local = local.detach().contiguous()
        if self.ep_size == 1:
            return local
        whole = local.new_empty(self.ep_size * local.numel())
        comm.all_gather_into_tensor(whole, local.reshape(-1), group=self.ep_group)
        return whole.reshape(self.ep_size * local.shape[0], *local.shape[1:])

    def _expert(self, j: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w_in[j]).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.w_out[j])

    def _run_local(self, rows: torch.Tensor, counts_RL: list[list[int]]) -> torch.Tensor:
        """Rows received source-major then local expert (counts_RL[r][j]); outputs in the same order."""
        pieces = list(rows.split([n for per_source in counts_RL for n in per_source]))
        local = self.num_local_experts
        outs: list = [None] * len(pieces)
        for j in range(local):
            mine = [pieces[r * local + j] for r in range(len(counts_RL))]
            for r, part in enumerate(self._expert(j, torch.cat(mine)).split([len(m) for m in mine])):
                outs[r * local + j] = part
        return torch.cat(outs)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        plan = plan_dispatch(top_k_index, self.num_experts, self.ep_size)
        rows = hidden_states[plan.token_N]
        if self.ep_size == 1:
            out = self._run_local(rows, [plan.counts_E.tolist()])
        else:
            recv_RL = exchange_counts(plan.counts_E, self.ep_group, self.ep_size)
            recv_rows = recv_RL.sum(dim=1).tolist()
            received = all_to_all(rows, self.ep_group, output_split_sizes=recv_rows, input_split_sizes=plan.send_rows)
            # Note [expert gradient scale] (sharded_moe.py): x ep in, 1/ep out
            scaled = _ScaleGrad.apply(received, float(self.ep_size))
            done = _ScaleGrad.apply(self._run_local(scaled, recv_RL.tolist()), 1.0 / self.ep_size)
            out = all_to_all(done, self.ep_group, output_split_sizes=plan.send_rows, input_split_sizes=recv_rows)
        weights = top_k_weights.reshape(-1)[plan.choice_N]
        weighted = (out * weights.unsqueeze(-1)).to(hidden_states.dtype)
        return torch.zeros_like(hidden_states).index_add(0, plan.token_N, weighted)


# -- finding and replacing blocks --------------------------------------------------------------------


def _fused_experts(experts: nn.Module, spec: AutoEPSpec, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    w1, w2 = getattr(experts, spec.w1, None), getattr(experts, spec.w2, None)
    if not isinstance(w1, torch.Tensor) or not isinstance(w2, torch.Tensor) or w1.dim() != 3 or w2.dim() != 3:
        raise ConfigError(
            f"AutoEP: {name}.{spec.experts} has no 3-D `{spec.w1}` / `{spec.w2}` expert weights (got "
            f"{type(experts).__name__}); a model built under zero.Init (partitioned) or with per-expert "
            "modules is not supported: build the model outside zero.Init, with transformers >= 5's "
            "fused experts, or set expert_parallel.expert_w1 / expert_w2"
        )
    others = [n for n, _ in experts.named_parameters() if n not in (spec.w1, spec.w2)]
    if others or getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False):
        raise ConfigError(
            f"AutoEP: {name}.{spec.experts} ({type(experts).__name__}) has expert biases or a "
            f"transposed layout ({others or 'flags'}); only bias-free gate_up_proj [E, 2I, H] / "
            "down_proj [E, H, I] experts are supported"
        )
    E, two_i, H = w1.shape
    if w2.shape != (E, H, two_i // 2) or two_i % 2:
        raise ConfigError(
            f"AutoEP: {name}.{spec.experts}: {spec.w1} {tuple(w1.shape)} and {spec.w2} "
            f"{tuple(w2.shape)} are not a fused [E, 2I, H] / [E, H, I] pair"
        )
    if not hasattr(experts, "act_fn"):
        raise ConfigError(f"AutoEP: {name}.{spec.experts} ({type(experts).__name__}) has no `act_fn`")
    return w1, w2


def find_moe_blocks(model: nn.Module, spec: AutoEPSpec = AutoEPSpec()) -> list[tuple[str, nn.Module]]:
    """(qualified name, block) of every sparse-MoE block: a module with children `spec.router` and
    `spec.experts`, the latter holding a weight `spec.w1`, its name matching `moe_layer_pattern`."""
    pattern = re.compile(spec.moe_layer_pattern) if spec.moe_layer_pattern else None
    found = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if spec.router not in children or spec.experts not in children:
            continue
        if pattern is not None and not pattern.fullmatch(name):
            continue
        if isinstance(children[spec.experts], ExpertParallelExperts):
            raise ConfigError(f"AutoEP: {name} is already expert-parallel (apply AutoEP once)")
        if pattern is None and not hasattr(children[spec.experts], spec.w1):
            continue
        found.append((name, module))
    return found


def apply_autoep(
    model: nn.Module, mesh, ep_size: int, spec: AutoEPSpec = AutoEPSpec(), expect: dict | None = None
) -> dict[int, nn.Parameter]:
    """Make every sparse-MoE block of `model` expert-parallel over `ep_size` ranks of `mesh`
    (collective: asks the mesh for the expert groups). Returns {id(replaced full parameter): this
    rank's new local parameter}. `expect` holds routing values the config asserted (checked against
    each block's router, Note [AutoEP keeps the model's router])."""
    if mesh.size("tp") > 1 or mesh.size("pp") > 1:
        raise ConfigError(
            f"expert_parallel with tensor or pipeline parallelism (tp={mesh.size('tp')}, "
            f"pp={mesh.size('pp')}) is not supported yet; use tp = pp = 1"
        )
    blocks = find_moe_blocks(model, spec)
    if not blocks:
        raise ConfigError(
            "expert_parallel.enabled=true but the model has no sparse-MoE block (a module with a "
            f"`{spec.router}` router and a fused `{spec.experts}` container"
            + (f" named like {spec.moe_layer_pattern!r}" if spec.moe_layer_pattern else "")
            + "); check expert_parallel.preset_model / moe_layer_pattern / router_pattern / "
            "expert_pattern"
        )
    if ep_size < 1 or mesh.size("dp_sp") % ep_size:  # Note [expert layout] (comm/topology.py)
        raise ConfigError(
            f"expert_parallel.autoep_size={ep_size} does not divide the data-parallel size "
            f"{mesh.size('dp')} x sequence-parallel size {mesh.size('sp')}; expert-parallel groups "
            "split each sequence-data-parallel group"
        )
    checked = []
    for name, block in blocks:  # every block is checked before any is replaced
        experts, router = getattr(block, spec.experts), getattr(block, spec.router)
        w1, w2 = _fused_experts(experts, spec, name)
        _check_routing(name, routing_facts(router, w1.shape[0]), expect or {})
        local_expert_range(w1.shape[0], ep_size, 0)
        checked.append((block, experts, w1, w2))
    ep_axis, edp_axis = mesh.expert_axes(ep_size)  # Note [expert parallel layout]
    ep_rank = comm.get_rank(ep_axis.handle)
    replaced: dict[int, nn.Parameter] = {}
    for block, experts, w1, w2 in checked:
        new = ExpertParallelExperts(
            w1, w2, experts.act_fn, w1.shape[0], ep_size, ep_rank, ep_axis.handle, (spec.w1, spec.w2), edp_axis.handle
        )
        replaced[id(w1)], replaced[id(w2)] = new.w_in, new.w_out
        setattr(block, spec.experts, new)
    log_dist(
        f"AutoEP: {len(blocks)} MoE blocks, {blocks[0][1].get_submodule(spec.experts).num_local_experts} "
        f"experts per rank, expert parallel size {ep_size}",
        ranks=[0],
    )
    return replaced


def _check_routing(name: str, facts: dict, expect: dict) -> None:
    for key, value in expect.items():
        if facts.get(key) != value:
            if facts.get(key) is None:
                raise ConfigError(
                    f"expert_parallel.{_FACT_KEYS[key]}={value!r}: zerospeed cannot tell what {name}'s "
                    "router does there (AutoEP keeps the model's own router); remove the key"
                )
            raise ConfigError(
                f"expert_parallel.{_FACT_KEYS[key]}: the config asks for {key}={value!r} but {name} has "
                f"{key}={facts.get(key)!r}; "
                "zerospeed's AutoEP keeps the model's own router (docs/moe.md), so the key may only "
                'restate it: remove the key (or set it to "auto" / null)'
            )


# -- the config ----------------------------------------------------------------------------------------


def _refuse(key: str, value, why: str) -> ConfigError:
    return ConfigError(
        f"expert_parallel.{key}={value!r}: {why} is not implemented in zerospeed's AutoEP; remove the key "
        "or set it to its default"
    )


def autoep_settings(ep, model: nn.Module) -> tuple[AutoEPSpec, dict]:
    """Pure: the block spec and the asserted routing values from the `expert_parallel` section `ep`
    (a config model or anything with its attributes); ConfigError for what is not implemented."""
    if ep.expert_tensor_parallel_size != 1:
        raise _refuse("expert_tensor_parallel_size", ep.expert_tensor_parallel_size, "expert tensor parallelism")
    if ep.comm_backend != "comm":
        raise _refuse("comm_backend", ep.comm_backend, "the DeepEP all-to-all backend")
    if ep.load_balance_coeff is not None:
        raise _refuse("load_balance_coeff", ep.load_balance_coeff, "auxiliary-loss-free (expert bias) load balancing")
    for key in ("num_expert_groups", "num_limited_groups"):
        if getattr(ep, key) is not None:
            raise _refuse(key, getattr(ep, key), "group-limited routing")
    if ep.route_scale != 1.0:
        raise _refuse("route_scale", ep.route_scale, "scaling the router's scores")
    if ep.routed_scaling_factor not in ("auto", 1.0):
        raise _refuse("routed_scaling_factor", ep.routed_scaling_factor, "scaling the routed experts' outputs")
    if ep.expert_w3 is not None:
        raise _refuse("expert_w3", ep.expert_w3, "separate gate and up expert weights (only a fused gate_up is)")
    if ep.has_shared_experts is not None or ep.shared_experts_pattern or ep.shared_experts_gate_pattern:
        _check_shared(ep, model)
    preset = {}
    if ep.preset_model is not None:
        if ep.preset_model in UNSUPPORTED_PRESETS:
            raise _refuse("preset_model", ep.preset_model, f"the {ep.preset_model} preset")
        if ep.preset_model not in PRESETS:
            raise ConfigError(
                f"expert_parallel.preset_model={ep.preset_model!r} is not a DeepSpeed AutoEP preset; "
                f"choose one of {sorted(PRESETS)} or leave it null (blocks are then found by shape)"
            )
        preset = PRESETS[ep.preset_model]
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in preset["model_types"]:
            raise ConfigError(
                f"expert_parallel.preset_model={ep.preset_model!r} but the model's config.model_type is "
                f"{model_type!r}; pick the model's own preset or leave preset_model null"
            )
    spec = AutoEPSpec(
        moe_layer_pattern=ep.moe_layer_pattern or preset.get("moe_layer_pattern"),
        router=ep.router_pattern or "gate",
        experts=ep.expert_pattern or "experts",
        w1=ep.expert_w1 or "gate_up_proj",
        w2=ep.expert_w2 or "down_proj",
    )
    expect = {key: getattr(ep, key) for key in ("score_func", "score_apply") if getattr(ep, key) != "auto"}
    if ep.route_norm is not None:
        expect["route_norm"] = ep.route_norm
    top_k = ep.top_k
    if top_k == "auto" and ep.top_k_attr is not None:
        top_k = _config_attr(model, ep.top_k_attr, "top_k_attr")
    if top_k != "auto":
        expect["top_k"] = int(top_k)
    num_attr = ep.num_experts_attr or preset.get("num_experts_attr")
    if num_attr is not None:
        expect["num_experts"] = int(_config_attr(model, num_attr, "num_experts_attr"))
    return spec, expect


def _config_attr(model: nn.Module, attr: str, key: str):
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, attr):
        raise ConfigError(f"expert_parallel.{key}={attr!r}: model.config has no attribute {attr!r}")
    return getattr(cfg, attr)


def _check_shared(ep, model: nn.Module) -> None:
    """Shared experts stay dense inside the block (Note [AutoEP keeps the model's router]); the keys
    are accepted when they describe the model."""
    if ep.has_shared_experts is False or not ep.shared_experts_pattern:
        return
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    for key in ("shared_experts_pattern", "shared_experts_gate_pattern"):
        child = getattr(ep, key)
        if child and child not in names:
            raise ConfigError(f"expert_parallel.{key}={child!r}: the model has no module named {child!r}")


def apply_autoep_config(model: nn.Module, mesh, cfg, optimizer=None, model_parameters=None):
    """`zerospeed.initialize`'s step: apply AutoEP when `cfg.expert_parallel.enabled`; returns
    `model_parameters` with every replaced expert parameter swapped for this rank's local one."""
    if cfg.use_data_before_expert_parallelism:
        raise ConfigError(
            "use_data_before_expert_parallelism=true (the data-major expert layout) is not implemented "
            "in zerospeed; remove the key: expert groups always split each data-parallel group"
        )
    ep = cfg.expert_parallel
    if ep is None or not ep.enabled:
        return model_parameters
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "expert_parallel.enabled=true with a client optimizer instance: AutoEP replaces the expert "
            "weights the optimizer holds; give the optimizer in the config (or as a callable "
            "params -> optimizer) instead"
        )
    done = converted_experts(model)
    if done:  # converted by hand (apply_autoep) already
        if any(m.ep_size != ep.autoep_size for _, m in done):
            raise ConfigError(
                f"expert_parallel.autoep_size={ep.autoep_size} but the model was made expert-parallel "
                f"with ep_size={done[0][1].ep_size} (apply_autoep); make them agree"
            )
        return model_parameters
    spec, expect = autoep_settings(ep, model)
    return substitute_parameters(model_parameters, apply_autoep(model, mesh, ep.autoep_size, spec, expect))


def converted_experts(model: nn.Module) -> list[tuple[str, ExpertParallelExperts]]:
    """(qualified name, container) of every expert-parallel expert container of `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)]


# -- a plain state dict --------------------------------------------------------------------------------


def consolidated_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The state dict of the plain transformers model (every expert, transformers' key names) from an
    AutoEP model whose other weights are whole on this rank (ZeRO 0-2; under ZeRO-3 wrap the call in
    `zerospeed.zero.GatheredParameters(list(model.parameters()))`). Collective over each block's
    expert-parallel group (an all-gather per expert tensor); every rank gets the whole dict."""
    state = dict(model.state_dict() if state_dict is None else state_dict)
    for name, experts in converted_experts(model):
        for pname in experts.param_names:
            state[f"{name}.{pname}"] = experts.all_experts(state[f"{name}.{pname}"])
    return state


def save_autoep_model(
    model: nn.Module, save_dir, *, safe_serialization: bool = True, max_shard_size: int | str | None = "5GB"
) -> list:
    """Write the plain transformers model (`consolidated_state_dict`, in the parameters' dtype, and
    `model.config`) to `save_dir` on rank 0, so that `<Model>.from_pretrained(save_dir)` loads it
    with no zerospeed at all. `model` is the AutoEP model or its engine. Collective (every rank
    calls it); under ZeRO-3 the whole model is gathered at once (one full copy per rank while it
    runs). Returns the files written (on rank 0; [] elsewhere)."""
    module = getattr(model, "module", model)
    with GatheredParameters(list(module.parameters())):
        state = consolidated_state_dict(module)
        state = {k: v.detach().cpu().clone() for k, v in state.items()} if comm.get_rank() == 0 else {}
    files = []
    if comm.get_rank() == 0:
        files = export_state_dict(state, save_dir, max_shard_size=max_shard_size, safe_serialization=safe_serialization)
        if getattr(module, "config", None) is not None and hasattr(module.config, "save_pretrained"):
            module.config.save_pretrained(save_dir)
    comm.barrier()
    return files
