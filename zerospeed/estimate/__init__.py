"""Memory estimator: ZeRO model-state formulas for every stage and offload, a model census, a planner,
per-rank parameters / activations under tensor and pipeline parallelism (`layout`), and the step's
predicted peak: model states plus every transient term, and which one dominates (`peak`).

DeepSpeed names: `estimate_zero2_model_states_mem_needs_all_live/_all_cold`,
`estimate_zero3_model_states_mem_needs_all_live/_all_cold`. CLI: `zerospeed-estimate`.
"""

from zerospeed.estimate.census import (
    ModelCensus,
    census_of_config,
    census_of_file,
    census_of_module,
    parse_count,
    transformer_params,
)
from zerospeed.estimate.deepspeed_api import (
    EstimateRow,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    zero2_rows,
    zero3_rows,
)
from zerospeed.estimate.formulas import (
    OPTIONS,
    Option,
    Precision,
    deepspeed_zero2_bytes,
    deepspeed_zero3_bytes,
    placed_model_states,
    stage_bytes,
    transformer_activation_bytes,
)
from zerospeed.estimate.layout import (
    TransformerShape,
    check_layout,
    layer_activation_bytes,
    stage_activation_bytes,
    stage_params,
)
from zerospeed.estimate.peak import EngineKnobs, Peak, Workload, peak_terms
from zerospeed.estimate.plan import PlanRow, Setup, layout_rows, plan_rows, recommend

__all__ = [
    "EngineKnobs",
    "EstimateRow",
    "ModelCensus",
    "OPTIONS",
    "Option",
    "Peak",
    "PlanRow",
    "Precision",
    "Setup",
    "TransformerShape",
    "Workload",
    "peak_terms",
    "census_of_config",
    "check_layout",
    "layer_activation_bytes",
    "layout_rows",
    "stage_activation_bytes",
    "stage_params",
    "census_of_file",
    "census_of_module",
    "deepspeed_zero2_bytes",
    "deepspeed_zero3_bytes",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "parse_count",
    "placed_model_states",
    "plan_rows",
    "recommend",
    "stage_bytes",
    "transformer_activation_bytes",
    "transformer_params",
    "zero2_rows",
    "zero3_rows",
]
