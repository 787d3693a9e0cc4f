"""DeepSpeed's engine accessors (the facade `zerospeed/runtime/deepspeed_api.py`) against what DeepSpeed's own
definitions give for the same config: each expected value below is written from the config given and
DeepSpeed's rule for that method (e.g. `zero_optimization()` is "stage > 0", `postscale_gradients()` is
"not prescale_gradients", `dynamic_loss_scale()` is "fp16.loss_scale == 0"), not read back from zerospeed.
Every public accessor DeepSpeed's engine has is present. One-process engines."""

from __future__ import annotations

import pytest
import torch

import zerospeed

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 3,
    "prescale_gradients": True,
    "gradient_predivide_factor": 2.0,
    "wall_clock_breakdown": True,
    "dataloader_drop_last": True,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 8,
        "loss_scale_window": 100,
        "hysteresis": 3,
        "min_loss_scale": 0.5,
    },
    "zero_optimization": {
        "stage": 2,
        "reduce_bucket_size": 12345,
        "allgather_bucket_size": 2345,
        "overlap_comm": False,
        "contiguous_gradients": False,
        "sub_group_size": 777,
        "offload_optimizer": {"device": "cpu"},
        "stage3_max_live_parameters": 99,
        "stage3_param_persistence_threshold": 11,
        "round_robin_gradients": True,
    },
    "progressive_layer_drop": {"enabled": True, "theta": 0.6, "gamma": 0.002},
    "flops_profiler": {"enabled": False, "profile_step": 3, "module_depth": 2, "top_modules": 4, "detailed": True},
    "checkpoint": {"tag_validation": "FAIL"},
    "data_types": {"grad_accum_dtype": "fp32"},
}


def _engine(config=CONFIG, optimizer=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, *_ = zerospeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, optimizer=optimizer
    )
    return engine


def test_every_public_deepspeed_accessor_reads_deepspeeds_meaning():
    e = _engine()
    assert e.get_batch_info() == (6, 2, 3)
    assert e.zero_optimization() and e.zero_optimization_partition_gradients()
    assert not e.zero_optimization_partition_weights()
    assert e.zero_reduce_bucket_size() == 12345 and e.zero_allgather_bucket_size() == 2345
    assert not e.zero_overlap_comm() and not e.zero_contiguous_gradients() and e.zero_sub_group_size() == 777
    assert e.zero_max_live_parameters() == 99 and e.zero_param_persistence_threshold() == 11
    assert e.zero_round_robin_gradients() and e.zero_reduce_scatter()  # DeepSpeed's default: true
    assert e.zero_offload_optimizer().device == "cpu" and e.zero_offload_param() is None
    assert e.zero_cpu_offload() and e.zero_use_cpu_optimizer() and not e.zero_nvme_offload_optimizer()
    assert e.optimizer_name() == "adamw"  # DeepSpeed lower-cases the names of its own optimizers
    assert e.optimizer_params() == {"lr": 1e-3, "betas": [0.8, 0.9]}
    assert e.get_mom() == [(0.8, 0.9)]  # the param group's betas
    assert e.scheduler_name() == "WarmupLR" and e.scheduler_params() == {"warmup_num_steps": 5}
    assert e.dynamic_loss_scale() and e.initial_dynamic_scale() == 256
    assert e.dynamic_loss_scale_args() == {
        "init_scale": 256,
        "scale_window": 100,
        "delayed_shift": 3,
        "consecutive_hysteresis": False,
        "min_scale": 0.5,
    }
    assert e.communication_data_type == torch.float16  # none configured: the fp16 training dtype
    assert e.get_data_types() == (torch.float16, torch.float32)
    assert not e.postscale_gradients() and e.gradient_predivide_factor() == 2.0
    assert e.wall_clock_breakdown() and e.dataloader_drop_last()
    assert e.pld_enabled() and e.pld_theta() == 0.6 and e.pld_gamma() == 0.002
    assert e.pld_params() == {"theta": 0.6, "gamma": 0.002}
    assert not e.flops_profiler_enabled() and e.flops_profiler_profile_step() == 3
    assert e.flops_profiler_module_depth() == 2 and e.flops_profiler_top_modules() == 4 and e.flops_profiler_detailed()
    assert e.checkpoint_tag_validation_enabled() and e.checkpoint_tag_validation_fail()
    assert e.get_data_parallel_rank() == 0 and e.get_model_parallel_rank() == 0 and e.get_tensor_parallel_rank() == 0
    assert not e.is_deepcompile_enabled() and not e.is_deepcompile_active() and not e.elasticity_enabled()
    assert e.autotp_size() == 0  # DeepSpeed's default: AutoTP off


def test_the_deepspeed_engine_method_list_is_covered():
    """Public methods of DeepSpeed 0.19's `DeepSpeedEngine` that read or change its configuration."""
    names = """get_batch_info set_train_batch_size set_train_micro_batch_size dataloader_drop_last deepspeed_io
    is_map_style_dataset is_iterable_style_dataset get_data_parallel_rank get_tensor_parallel_rank
    get_model_parallel_rank get_sequence_parallel_group optimizer_name optimizer_params optimizer_legacy_fusion
    scheduler_name scheduler_params get_type get_mom zero_allow_untested_optimizer zero_force_ds_cpu_optimizer
    dynamic_loss_scale initial_dynamic_scale dynamic_loss_scale_args fp16_auto_cast fp16_master_weights_and_gradients
    bf16_master_weights_and_gradients bf16_optimizer_states amp_enabled amp_params torch_autocast_enabled
    torch_autocast_dtype torch_autocast_lower_precision_safe_modules communication_data_type get_data_types
    postscale_gradients gradient_predivide_factor zero_optimization zero_optimization_partition_gradients
    zero_optimization_partition_weights zero_offload_optimizer zero_offload_param zero_cpu_offload
    zero_use_cpu_optimizer zero_nvme_offload_optimizer zero_partial_offload super_offload cpuadam_cores_perc
    zero_max_live_parameters zero_max_reuse_distance zero_prefetch_bucket_size zero_module_granularity_threshold
    zero_param_persistence_threshold zero_model_persistence_threshold zero_allgather_sequential
    is_sanity_checks_enabled zero_multi_rank_bucket_allreduce zero_log_trace_cache_warnings mics_shard_size
    zenflow_config zero_reduce_scatter zero_overlap_comm zero_sub_group_size zero_reduce_bucket_size
    zero_allgather_bucket_size zero_contiguous_gradients zero_load_from_fp32_weights zero_elastic_checkpoint
    zero_legacy_stage1 zero_ignore_unused_parameters zero_allgather_partitions zero_round_robin_gradients
    zero_hpz_partition_size zero_quantized_weights zero_quantized_nontrainable_weights zero_quantized_gradients
    zeropp_loco_param zero_save_muon_momentum_buffer_in_memory wall_clock_breakdown dump_state log_level
    graph_harvesting sparse_gradients_enabled managed_gradient_accumulation elasticity_enabled pld_enabled
    pld_params pld_theta pld_gamma eigenvalue_enabled eigenvalue_verbose eigenvalue_max_iter eigenvalue_tol
    eigenvalue_stability eigenvalue_gas_boundary_resolution eigenvalue_layer_name eigenvalue_layer_num
    data_efficiency_enabled data_efficiency_config data_sampling_enabled data_sampling_config
    curriculum_learning_enabled curriculum_learning_config flops_profiler_enabled flops_profiler_profile_step
    flops_profiler_detailed flops_profiler_recompute_fwd_factor flops_profiler_module_depth
    flops_profiler_top_modules flops_profiler_output_file autotuning_enabled autotuning_start_profile_step
    autotuning_end_profile_step autotuning_metric autotuning_metric_path autotuning_model_info_path
    autotuning_profile_model_info tensor_parallel_config autotp_size use_node_local_storage
    load_universal_checkpoint aio_config checkpoint_tag_validation_enabled checkpoint_tag_validation_fail
    checkpoint_serialization_enabled checkpoint_writer_enabled is_deepcompile_enabled is_deepcompile_active
    module_state_dict save_fp16_model compile is_compiled empty_partition_cache""".split()
    e = _engine()
    missing = [n for n in names if not hasattr(e, n)]
    assert not missing, missing
    for n in names:  # every one answers without error (the mutating and argument-taking ones excepted)
        if n in {
            "set_train_batch_size",
            "set_train_micro_batch_size",
            "deepspeed_io",
            "is_map_style_dataset",
            "is_iterable_style_dataset",
            "save_fp16_model",
            "compile",
            "get_type",
        }:
            continue
        value = getattr(e, n)
        if callable(value):
            value()


def test_batch_size_setters_change_accumulation_or_micro_batch_like_deepspeed():
    e = _engine({**CONFIG, "fp16": {"enabled": False}, "progressive_layer_drop": {"enabled": False}})
    e.set_train_batch_size(10)  # micro 2 x dp 1: 5 accumulation steps
    assert e.get_batch_info() == (10, 2, 5)
    with pytest.raises(ValueError, match="multiple of train_micro_batch_size_per_gpu"):
        e.set_train_batch_size(7)
    e.set_train_micro_batch_size(4)  # accumulation stays 5
    assert e.get_batch_info() == (20, 4, 5)
    x = torch.randn(4, 4)
    for step in range(5):  # the boundary follows the new accumulation: one optimizer step after 5 micro-steps
        e.backward(e(x).float().pow(2).mean())
        e.step()
        assert e.global_steps == (1 if step == 4 else 0)


def test_deepspeed_io_gives_this_ranks_batches_and_module_state_dict_drops_frozen():
    e = _engine({**CONFIG, "fp16": {"enabled": False}})
    data = torch.utils.data.TensorDataset(torch.arange(10.0).unsqueeze(1))
    ordered = [b[0].flatten().tolist() for b in e.deepspeed_io(data, route="eval")]
    assert ordered == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]
    shuffled = sorted(v for b in e.deepspeed_io(data) for v in b[0].flatten().tolist())
    assert shuffled == [float(i) for i in range(10)]
    e.module[0].weight.requires_grad_(False)
    assert set(e.module_state_dict(exclude_frozen_parameters=True)) == {"0.bias", "1.weight", "1.bias"}
    assert set(e.module_state_dict()) == set(e.module.state_dict())
