"""DeepSpeed's `injection_policy` as AutoTP partition rules.

An injection policy names, per transformer-layer class, the linear layers whose outputs are summed over
the tp ranks: `{GPT2Block: ("attn.c_proj", "mlp.c_proj")}`. Those are row-parallel; every other linear
inside such a layer is column-parallel, and a linear outside every policy layer is left whole (manual
TP splits exactly what the policy covers). A column layer keeps the fused `shape` its default rule
gives it (GPT-2's c_attn is [q | k | v]: a plain column split would hand a rank some of q and none of
v). Pure: names and rules in, a `partition_config` dict out.
"""

from __future__ import annotations

import re

from zerospeed.parallel.tensor.plan import Rule, first_match


def policy_partition_config(
    linears: list[str], policy_layers: dict[str, tuple[str, ...]], default_rules: tuple[Rule, ...] = ()
) -> dict:
    """`linears`: every linear module's name; `policy_layers`: {policy layer's module name: its row-parallel
    names}. Returns DeepSpeed's partition_config (use_default_specs false) covering every linear."""
    specs = []
    for name in linears:
        owner = next((p for p in policy_layers if name.startswith(p + ".")), None)
        pattern = "^" + re.escape(name) + r"\.weight$"
        if owner is None:
            specs.append({"patterns": [pattern], "partition_type": "skip"})
            continue
        inner = name[len(owner) + 1 :]
        if any(inner == r or inner.endswith("." + r) for r in policy_layers[owner]):
            specs.append({"patterns": [pattern], "partition_type": "row"})
            continue
        default = first_match(name + ".weight", default_rules)
        spec = {"patterns": [pattern], "partition_type": "column"}
        if default is not None and default.kind == "column" and default.shape:
            spec["shape"] = [list(s) if isinstance(s, tuple) else s for s in default.shape]
        specs.append(spec)
    return {"use_default_specs": False, "layer_specs": specs}


def unmatched_policy_names(module_names: list[str], policy_layers: dict[str, tuple[str, ...]]) -> list[str]:
    """Row-parallel names of the policy that name no module in their layer (DeepSpeed refuses them too)."""
    missing = []
    for owner, rows in policy_layers.items():
        inside = [n[len(owner) + 1 :] for n in module_names if n.startswith(owner + ".")]
        missing += [r for r in rows if not any(i == r or i.endswith("." + r) for i in inside) and r not in missing]
    return missing
