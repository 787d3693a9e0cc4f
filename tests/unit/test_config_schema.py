"""Schema tests: real user configs parse, every documented section round-trips, DeepSpeed defaults."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from zerospeed.config import ConfigError, ZeroSpeedConfig, auto_values_from_hidden_size, parse_config

SHARED_CONFIGS = Path(__file__).parents[2].parent / "shared" / "configs"


def shared(name: str) -> Path:
    path = SHARED_CONFIGS / name
    if not path.is_file():
        pytest.skip(f"{path} not available")
    return path


# --- the three configs users already have ------------------------------------------------------


def test_zero2_full_parses_at_world_size_1():
    cfg = parse_config(shared("zero2_full.json"), world_size=1, check_features=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 4)
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params == {"lr": 2e-5, "betas": [0.9, 0.95], "weight_decay": 0.01}
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 100}
    assert cfg.fp16_enabled and cfg.dynamic_loss_scale and not cfg.bf16_enabled
    assert (cfg.fp16.loss_scale_window, cfg.fp16.initial_scale_power, cfg.fp16.hysteresis) == (1000, 16, 2)
    assert cfg.fp16.min_loss_scale == 1.0
    zero = cfg.zero_optimization
    assert cfg.zero_stage == 2 and zero.overlap_comm and zero.contiguous_gradients and zero.reduce_scatter
    # 2e8 in the JSON is a float; integer fields hold the exact int.
    assert zero.allgather_bucket_size == 200_000_000 and type(zero.allgather_bucket_size) is int
    assert zero.reduce_bucket_size == 200_000_000 and type(zero.reduce_bucket_size) is int
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 10 and cfg.wall_clock_breakdown is False


def test_zero2_full_at_world_size_2_shows_the_arithmetic():
    with pytest.raises(ConfigError) as info:
        parse_config(shared("zero2_full.json"), world_size=2, check_features=False)
    message = str(info.value)
    assert (
        "train_batch_size 16 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 4 "
        "* data-parallel world size 2 = 32"
    ) in message
    assert "change them together" in message
    assert "train_batch_size to 32" in message and "gradient_accumulation_steps to 2" in message


def test_zero2_full_passes_the_feature_check():
    cfg = parse_config(shared("zero2_full.json"))
    assert cfg.zero_stage == 2 and cfg.fp16_enabled and cfg.train_batch_size == 16


def test_zero3_cpu_offload_needs_known_values():
    known = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        **auto_values_from_hidden_size(1024),
    }
    cfg = parse_config(shared("zero3_cpu_offload.json"), world_size=4, known=known, check_features=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (24, 2, 3)
    zero = cfg.zero_optimization
    assert zero.stage3_prefetch_bucket_size == 943_718  # int(0.9 * 1024 * 1024)
    assert zero.stage3_param_persistence_threshold == 10_240
    assert zero.sub_group_size == 1_000_000_000 and zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory is True
    assert zero.offload_param.device == "cpu" and zero.offload_param.pin_memory is True
    assert zero.stage3_gather_16bit_weights_on_model_save is True


def test_zero3_cpu_offload_without_known_names_the_auto_keys():
    with pytest.raises(ConfigError) as info:
        parse_config(shared("zero3_cpu_offload.json"), check_features=False)
    assert 'zero_optimization.stage3_prefetch_bucket_size is "auto"' in str(info.value)
    assert 'zero_optimization.stage3_param_persistence_threshold is "auto"' in str(info.value)


def test_zero3_cpu_offload_passes_the_feature_check_now_that_offload_exists():
    known = {"train_micro_batch_size_per_gpu": 1, **auto_values_from_hidden_size(8)}
    cfg = parse_config(shared("zero3_cpu_offload.json"), known=known)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_param.device == "cpu"


def test_zero2_cpu_offload_auto_with_trainer_values():
    known = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "fp16.enabled": True,
    }
    cfg = parse_config(shared("zero2_cpu_offload_auto.json"), world_size=2, known=known, check_features=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 8, 2)
    assert cfg.gradient_clipping == 0.5 and cfg.fp16_enabled is True
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


# --- every documented section, with non-default values ------------------------------------------


def every_key_config() -> dict:
    """A config touching every section at every level, values chosen to differ from defaults."""
    return {
        "train_batch_size": 12,
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 4,
        "managed_gradient_accumulation": False,
        "optimizer": {"type": "Lamb", "params": {"lr": 0.01, "betas": [0.8, 0.9]}, "legacy_fusion": True},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001}},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "gradient_clipping": 2.5,
        "prescale_gradients": True,
        "gradient_predivide_factor": 4.0,
        # "sum" (parsed in test_gradient_allreduce_op_is_deepspeeds_key) is refused at stage 3, as in DeepSpeed
        "gradient_allreduce_op": "mean",
        "communication_data_type": "bf16",
        "seq_parallel_communication_data_type": "fp16",
        "sparse_gradients": True,
        "disable_allgather": True,
        "graph_harvesting": True,
        "fp16": {
            "enabled": False,
            "auto_cast": True,
            "loss_scale": 128.0,
            "initial_scale_power": 12,
            "loss_scale_window": 500,
            "hysteresis": 3,
            "consecutive_hysteresis": True,
            "min_loss_scale": 0.5,
            "fp16_master_weights_and_grads": True,
        },
        "bf16": {
            "enabled": True,
            "immediate_grad_update": True,
            "check_grad_overflow": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": True,
        },
        "amp": {"enabled": True, "opt_level": "O2", "loss_scale": "dynamic"},
        "torch_autocast": {"enabled": True, "dtype": "float16", "lower_precision_safe_modules": ["torch.nn.Linear"]},
        "data_types": {"grad_accum_dtype": "bf16", "param_dtype": "fp16", "buffer_dtype": "fp32"},
        "zero_optimization": {
            "stage": 3,
            "contiguous_gradients": False,
            "reduce_scatter": False,
            "reduce_bucket_size": 1e7,
            "use_multi_rank_bucket_allreduce": False,
            "allgather_partitions": False,
            "allgather_bucket_size": 3e7,
            "overlap_comm": False,
            "load_from_fp32_weights": False,
            "elastic_checkpoint": True,
            "offload_param": {
                "device": "nvme",
                "nvme_path": "/nvme",
                "buffer_count": 6,
                "buffer_size": 2e8,
                "max_in_cpu": 2e9,
                "pin_memory": True,
            },
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": "/nvme2",
                "buffer_count": 5,
                "pin_memory": True,
                "pipeline_read": True,
                "pipeline_write": True,
                "fast_init": True,
                "ratio": 0.3,
                "super_offload": True,
                "convert_grad_on_cpu": False,
                "cpuadam_cores_perc": 0.5,
            },
            "zenflow": {
                "topk_ratio": 0.2,
                "select_strategy": "step",
                "select_interval": 10,
                "update_interval": "auto",
                "overlap_step": True,
                "offload": True,
                "auto_ratio": 0.9,
                "full_warm_up_rounds": 2,
                "pt_reserved_cores_perc": 0.25,
            },
            "sub_group_size": 1e8,
            "stage3_prefetch_bucket_size": 1e6,
            "stage3_param_persistence_threshold": 1e4,
            "stage3_model_persistence_threshold": 1e10,
            "stage3_max_live_parameters": 2e8,
            "stage3_max_reuse_distance": 3e8,
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_module_granularity_threshold": 7,
            "stage3_use_all_reduce_for_fetch_params": True,
            "stage3_allgather_sequential": True,
            "ignore_unused_parameters": False,
            "legacy_stage1": True,
            "round_robin_gradients": True,
            "zero_hpz_partition_size": 8,
            "zero_quantized_weights": True,
            "zero_quantized_nontrainable_weights": True,
            "zero_quantized_gradients": True,
            "zeropp_loco_param": {"err_beta": 0.7, "reset_T": 512},
            "mics_shard_size": 4,
            "mics_hierarchical_params_gather": True,
            "memory_efficient_linear": False,
            "pipeline_loading_checkpoint": True,
            "override_module_apply": False,
            "log_trace_cache_warnings": True,
            "enable_sanity_checks": True,
            "compute_grad_norm": False,
            "parameter_alignment": True,
            "save_muon_momentum_buffer_in_memory": True,
            "leaf_module": {"classes": ["my.Block"], "names": ["layers.0"], "name_suffixes": "moe"},
        },
        "aio": {
            "io_backend": "posix",
            "block_size": 262144,
            "queue_depth": 32,
            "intra_op_parallelism": 2,
            "thread_count": 2,
            "single_submit": True,
            "overlap_events": False,
            "use_gds": True,
        },
        "activation_checkpointing": {
            "partition_activations": True,
            "cpu_checkpointing": True,
            "contiguous_memory_optimization": True,
            "number_checkpoints": 12,
            "synchronize_checkpoint_boundary": True,
            "profile": True,
        },
        "pipeline": {
            "stages": 4,
            "partition": "uniform",
            "seed_layers": True,
            "activation_checkpoint_interval": 2,
            "pipe_partitioned": False,
            "grad_partitioned": False,
        },
        "tensor_parallel": {
            "autotp_size": 2,
            "tp_overlap_comm": True,
            "vocab_parallel_lm_head": True,
            "preset_model": "llama",
            "dtype": "bf16",
            "keep_module_on_host": True,
            "kernel_inject": True,
            "tp": {"tp_size": 2, "tp_grain_size": 64},
            "partition_config": {
                "use_default_specs": False,
                "layer_specs": [
                    {
                        "patterns": [".*o_proj"],
                        "partition_type": "row",
                        "shape": [2, -1],
                        "partition_dim": 0,
                        "model_types": ["llama"],
                    }
                ],
            },
        },
        "expert_parallel": {
            "enabled": True,
            "autoep_size": 4,
            "preset_model": "mixtral",
            "top_k": 2,
            "routed_scaling_factor": 2.5,
            "score_func": "sigmoid",
            "score_apply": "post",
            "combine_impl": "weighted_sum",
            "comm_backend": "deepep",
            "comm_max_tokens_per_rank": 64,
            "num_expert_groups": 8,
            "num_limited_groups": 4,
            "expert_w3": None,
            "has_shared_experts": True,
            "shared_experts_pattern": "shared_expert",
        },
        "sequence_parallel_size": 2,
        "use_data_before_expert_parallelism": True,
        "hybrid_engine": {
            "enabled": True,
            "max_out_tokens": 256,
            "inference_tp_size": 2,
            "release_inference_cache": True,
            "pin_parameters": False,
            "tp_gather_partition_size": 4,
            "enable_cuda_graph": True,
        },
        "compile": {
            "deepcompile": True,
            "free_activation": True,
            "passes": ["z3", "autosp"],
            "enabled": True,
            "backend": "eager",
            "kwargs": {"fullgraph": True},
        },
        "steps_per_print": 7,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "dump_state": True,
        "log_level": "debug",
        "disable_python_gc": True,
        "tensorboard": {"enabled": True, "output_path": "tb/", "job_name": "job"},
        "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"},
        "csv_monitor": {"enabled": True, "output_path": "csv/", "job_name": "job2"},
        "comet": {
            "enabled": True,
            "samples_log_interval": 50,
            "project": "p",
            "workspace": "w",
            "experiment_name": "e",
            "online": False,
            "mode": "get",
        },
        "comms_logger": {
            "enabled": True,
            "verbose": True,
            "prof_all": False,
            "debug": True,
            "prof_ops": ["all_reduce"],
        },
        "flops_profiler": {
            "enabled": True,
            "recompute_fwd_factor": 1.0,
            "profile_step": 3,
            "module_depth": 2,
            "top_modules": 5,
            "detailed": False,
            "output_file": "flops.txt",
        },
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "autotuning": {
            "enabled": True,
            "fast": False,
            "metric": "latency",
            "tuner_type": "model_based",
            "max_train_batch_size": 1024,
            "model_info": {"profile": True, "num_params": 1000},
        },
        "checkpoint": {
            "tag_validation": "Fail",
            "load_universal": True,
            "use_node_local_storage": True,
            "parallel_write": {"pipeline_stage": True},
            "checkpoint_serialization": False,
            "writer": {"type": "python", "io_buffer_size": 1024, "data_parallel": "socket"},
        },
        "nebula": {
            "enabled": True,
            "persistent_storage_path": "/ckpt",
            "persistent_time_interval": 30,
            "num_of_version_in_retention": 3,
        },
        "datastates_ckpt": {"host_cache_size": 16},
        "async_load": True,
        "dataloader_drop_last": True,
        "vocabulary_size": 50304,
        "elasticity": {
            "enabled": True,
            "max_train_batch_size": 4000,
            "micro_batch_sizes": [1, 2],
            "min_gpus": 1,
            "max_gpus": 64,
            "min_time": 5,
            "prefer_larger_batch": False,
            "version": 0.1,
            "ignore_non_elastic_batch_info": True,
            "model_parallel_size": 1,
            "num_gpus_per_node": 1,
        },
        "sparse_attention": {
            "mode": "bigbird",
            "block": 32,
            "num_random_blocks": 2,
            "num_sliding_window_blocks": 5,
            "local_window_blocks": [2, 4],
            "global_block_end_indices": [1],
        },
        "curriculum_learning": {
            "enabled": True,
            "curriculum_type": "seqlen",
            "min_difficulty": 8,
            "max_difficulty": 1024,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": 40000, "difficulty_step": 8},
        },
        "data_efficiency": {
            "enabled": True,
            "seed": 7,
            "data_sampling": {
                "enabled": True,
                "num_epochs": 2,
                "num_workers": 3,
                "curriculum_learning": {"enabled": True, "data_cluster_path": "/c", "curriculum_metrics": {"m": {}}},
            },
            "data_routing": {
                "enabled": True,
                "random_ltd": {
                    "enabled": True,
                    "total_layer_num": 24,
                    "random_ltd_layer_num": 2,
                    "random_ltd_layer_id": [1, 22],
                    "model_mask_name": "attention_mask",
                    "model_type": "encoder",
                    "hidden_state_order": "seq_batch_dim",
                    "micro_batch_size": 4,
                    "global_batch_size": 64,
                    "random_ltd_schedule": {
                        "min_value": 128,
                        "max_value": 2048,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"require_steps": 200000, "seq_per_step": 16},
                    },
                    "layer_token_lr_schedule": {
                        "enabled": True,
                        "total_layer_tokens": 10**9,
                        "warmup_type": "linear",
                        "warmup_layer_tokens": 10**6,
                    },
                },
            },
        },
        "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.01},
        "eigenvalue": {"enabled": True, "verbose": True, "max_iter": 50, "tol": 0.1, "layer_num": 12},
        "quantize_training": {
            "enabled": True,
            "quantize_bits": {"start_bits": 12, "target_bits": 4},
            "quantize_schedule": {"quantize_period": 10, "schedule_offset": 5},
            "quantize_groups": 8,
            "fp16_mixed_quantize": {"enabled": True},
            "quantize_algo": {"q_type": "asymmetric", "rounding": "stochastic"},
        },
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True},
                "different_groups": {"wq1": {"modules": ["attn"], "params": {"start_bits": 8, "target_bits": 4}}},
            },
            "layer_reduction": {"enabled": True, "keep_number_layer": 5},
        },
        "weight_quantization": {"num_bits": 4, "q_type": "asymmetric", "q_groups": 64},
    }


def test_every_documented_key_round_trips():
    raw = every_key_config()
    cfg = parse_config(copy.deepcopy(raw), check_features=False)
    zero = cfg.zero_optimization
    assert zero.stage == 3 and zero.reduce_bucket_size == 10_000_000 and zero.overlap_comm is False
    assert zero.offload_param.buffer_size == 200_000_000 and zero.offload_param.nvme_path == "/nvme"
    assert zero.offload_optimizer.ratio == 0.3 and zero.offload_optimizer.convert_grad_on_cpu is False
    assert zero.zenflow.select_interval == 10 and zero.zenflow.update_interval == "auto"
    assert zero.stage3_model_persistence_threshold == 10_000_000_000
    assert zero.leaf_module.name_suffixes == ["moe"]  # a single string becomes a list, as in DeepSpeed
    assert cfg.gradient_allreduce_op == "mean" and cfg.communication_data_type == "bf16"
    assert cfg.torch_autocast.dtype == "fp16" and cfg.seq_parallel_communication_data_type == "fp16"
    assert cfg.fp16.loss_scale == 128.0 and cfg.fp16.min_loss_scale == 0.5 and not cfg.dynamic_loss_scale
    assert cfg.bf16_enabled and cfg.bf16.bf16_optimizer_states
    assert cfg.amp.opt_level == "O2" and cfg.amp.loss_scale == "dynamic"
    assert cfg.aio.io_backend == "posix" and cfg.aio.block_size == 262144
    assert cfg.pipeline.stages == 4 and cfg.pipeline.partition == "uniform"
    spec = cfg.tensor_parallel.partition_config.layer_specs[0]
    assert (spec.partition_type, spec.shape, spec.partition_dim) == ("row", [2, -1], 0)
    assert cfg.tensor_parallel.tp.tp_grain_size == 64
    assert cfg.expert_parallel.top_k == 2 and cfg.expert_parallel.routed_scaling_factor == 2.5
    assert cfg.checkpoint.tag_validation == "FAIL" and cfg.checkpoint.writer.type == "PYTHON"
    assert cfg.checkpoint.writer.data_parallel == "SOCKET"
    assert cfg.comet.mode == "get" and cfg.comms_logger.prof_ops == ["all_reduce"]
    assert cfg.timers.throughput.synchronized is False
    assert cfg.autotuning.model_info.num_params == 1000 and cfg.autotuning.tuner_type == "model_based"
    assert cfg.sparse_attention.mode == "bigbird" and cfg.sparse_attention.local_window_blocks == [2, 4]
    assert cfg.data_efficiency.data_sampling.curriculum_learning.curriculum_metrics == {"m": {}}
    ltd = cfg.data_efficiency.data_routing.random_ltd
    assert ltd.model_type == "encoder" and ltd.random_ltd_schedule.schedule_config.seq_per_step == 16
    assert cfg.quantize_training.quantize_algo.rounding == "stochastic"
    assert cfg.compression_training.layer_reduction.keep_number_layer == 5
    assert cfg.compression_training.weight_quantization.different_groups["wq1"].params.target_bits == 4
    assert cfg.weight_quantization.q_groups == 64 and cfg.weight_quantization.enabled is True
    assert cfg.compile.passes == ["z3", "autosp"] and cfg.compile.kwargs == {"fullgraph": True}


def test_every_documented_key_dump_reparses_to_the_same_model():
    cfg = parse_config(every_key_config(), check_features=False)
    again = parse_config(json.loads(cfg.model_dump_json()), check_features=False)
    assert again == cfg


def test_every_documented_key_config_trips_many_feature_rows():
    with pytest.raises(ConfigError) as info:
        parse_config(every_key_config())
    lines = str(info.value).splitlines()
    assert lines  # (every feature built deletes its row: 42 before curriculum learning and PLD; issue 48 aims at <= 6)
    not_yet = "is not implemented in zerospeed yet (tracked as a later issue)"
    deepspeed_too = "and zerospeed does not build it either"  # features.DEEPSPEED_REFUSED
    assert all(not_yet in line or deepspeed_too in line for line in lines)
    assert any(not_yet in line for line in lines) and any(deepspeed_too in line for line in lines)


# --- defaults are DeepSpeed's -------------------------------------------------------------------


def test_defaults_match_deepspeed():
    cfg = parse_config({"train_batch_size": 8})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 8, 1)
    assert cfg.fp16.loss_scale == 0.0 and cfg.fp16.initial_scale_power == 16 and cfg.fp16.loss_scale_window == 1000
    assert cfg.fp16.hysteresis == 2 and cfg.fp16.consecutive_hysteresis is False and cfg.fp16.min_loss_scale == 1.0
    assert cfg.fp16_enabled is False and cfg.bf16_enabled is False and cfg.dynamic_loss_scale is False
    assert cfg.optimizer is None and cfg.scheduler is None
    # (DeepSpeed 0.19.8 clips at 1.0 unless told otherwise: deepspeedai/DeepSpeed#8068 changed the default from 0)
    assert cfg.gradient_clipping == 1.0 and cfg.prescale_gradients is False and cfg.gradient_predivide_factor == 1.0
    assert cfg.communication_data_type is None and cfg.gradient_allreduce_op == "mean"
    assert cfg.steps_per_print is None and cfg.zero_allow_untested_optimizer is False
    zero = cfg.zero_optimization
    assert zero.stage == 0 and zero.overlap_comm is False and zero.contiguous_gradients is True
    assert zero.reduce_bucket_size == 500_000_000 and zero.allgather_bucket_size == 500_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000 and zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_model_persistence_threshold == sys.maxsize and zero.sub_group_size == 1_000_000_000
    assert zero.offload_optimizer is None and zero.offload_param is None
    assert cfg.aio.block_size == 1_048_576 and cfg.aio.queue_depth == 8
    assert cfg.checkpoint.tag_validation == "WARN" and cfg.data_types.grad_accum_dtype is None
    assert cfg.pipeline.stages == "auto" and cfg.pipeline.partition == "best"
    assert cfg.comms_logger.prof_all is True and cfg.flops_profiler.module_depth == -1


def test_overlap_comm_default_is_true_under_stage_3():
    cfg = parse_config({"train_batch_size": 1, "zero_optimization": {"stage": 3}}, check_features=False)
    assert cfg.zero_optimization.overlap_comm is True


def test_offload_section_defaults():
    cfg = parse_config({"train_batch_size": 1, "zero_optimization": {"offload_optimizer": {}, "offload_param": {}}})
    assert cfg.zero_optimization.offload_optimizer.device == "none"
    assert cfg.zero_optimization.offload_optimizer.buffer_count == 4
    assert cfg.zero_optimization.offload_param.buffer_count == 5
    assert cfg.zero_optimization.offload_param.max_in_cpu == 1_000_000_000


def test_every_field_has_a_description_naming_the_default():
    from pydantic import BaseModel

    from zerospeed.config.validation import _model_in

    seen, todo = set(), [ZeroSpeedConfig]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            says = "Required" if field.is_required() else "Default"
            assert field.description and says in field.description, f"{model.__name__}.{name}"
            inner = _model_in(field.annotation)
            if inner is not None and issubclass(inner, BaseModel):
                todo.append(inner)
    assert len(seen) > 40


# --- numbers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [(2e8, 200_000_000), (1e9, 1_000_000_000), (5.0, 5), (12, 12)])
def test_integral_floats_become_ints(text, expected):
    cfg = parse_config({"train_batch_size": 1, "zero_optimization": {"reduce_bucket_size": text}})
    assert cfg.zero_optimization.reduce_bucket_size == expected
    assert type(cfg.zero_optimization.reduce_bucket_size) is int


def test_non_integral_float_for_int_field_is_rejected():
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 1, "zero_optimization": {"reduce_bucket_size": 2.5}})
    assert str(info.value) == (
        "zero_optimization.reduce_bucket_size: expected a non-negative integer, got 2.5 (not a whole number)"
    )


def test_bool_is_not_a_number():
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": True})
    assert str(info.value) == "train_batch_size: expected a positive integer or null, got true"


@pytest.mark.parametrize(
    "value,normalised", [("FP32", "fp32"), ("float16", "fp16"), ("bfloat16", "bf16"), ("bfp16", "bf16"), (None, None)]
)
def test_communication_data_type_is_normalised(value, normalised):
    cfg = parse_config({"train_batch_size": 1, "communication_data_type": value})
    assert cfg.communication_data_type == normalised


def test_gradient_allreduce_op_is_deepspeeds_key():
    assert parse_config({"train_batch_size": 1, "gradient_allreduce_op": "SUM"}).gradient_allreduce_op == "sum"
    with pytest.raises(ConfigError) as info:
        parse_config({"train_batch_size": 1, "gradient_allreduce_op": "avg"})
    assert str(info.value) == "gradient_allreduce_op: expected one of 'mean', 'sum', got 'avg'"
