"""save_checkpoint / load_checkpoint / save_16bit_model through one-process engines: round trips,
`latest`, errors that name the file or the parameters, partial loads, interrupted saves."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

import zerospeed
from zerospeed.checkpoint import CheckpointError
from zerospeed.checkpoint.manifest import read_manifest
from zerospeed.zero.shards import parameter_names
from zoo.models import GPT, GPTConfig


@pytest.fixture(autouse=True)
def one_thread():
    # These models are tiny: a second intra-op thread only spins against other processes here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SMALL = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=1, n_embd=15, bias=False)


def config(stage=1, **over):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 400},
    }
    cfg.update(over)
    return cfg


def engine_for(stage=1, seed=0, model_cfg=SMALL, **over):
    torch.manual_seed(seed)
    model = GPT(model_cfg)
    model.wpe.weight.requires_grad_(False)
    engine, *_ = zerospeed.initialize(model=model, config=config(stage, **over))
    return engine


def train(engine, steps=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 8), generator=g)
        engine.backward(engine(x, x))
        engine.step()


def weights(engine):
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def assert_weights_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_stage_1_checkpoint_continues_identically_at_stage_2(tmp_path):
    src = engine_for(stage=1)
    train(src)
    src.save_checkpoint(tmp_path, client_state={"epoch": 4})
    dst = engine_for(stage=2, seed=1)
    path, client = dst.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "global_step2" / "mp_rank_00_model_states.pt")
    assert client == {"epoch": 4}
    assert_weights_equal(weights(src), weights(dst))
    assert (dst.global_steps, dst.global_samples, dst.micro_steps) == (2, 4, 2)
    train(src, seed=5)
    train(dst, seed=5)
    assert_weights_equal(weights(src), weights(dst))
    assert dst.get_lr() == src.get_lr()


def test_a_missing_latest_is_a_warning_and_returns_none(tmp_path, caplog):
    engine = engine_for()
    with caplog.at_level(logging.WARNING, logger="zerospeed.checkpoint.load"):
        assert engine.load_checkpoint(tmp_path / "empty") == (None, None)
    assert f"there is no {tmp_path / 'empty' / 'latest'} file naming a tag" in caplog.text


def test_an_explicit_missing_tag_or_an_incomplete_directory_is_an_error(tmp_path):
    engine = engine_for()
    with pytest.raises(CheckpointError, match=f"checkpoint directory {tmp_path}/nope does not exist"):
        engine.load_checkpoint(tmp_path, tag="nope")
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError, match=f"{tmp_path}/half/zerospeed_manifest.json is missing"):
        engine.load_checkpoint(tmp_path, tag="half")


@pytest.mark.parametrize(
    "how,message", [("flip", "is corrupted: sha256"), ("truncate", "is truncated: "), ("delete", "is missing")]
)
def test_a_damaged_file_is_named(tmp_path, how, message):
    engine = engine_for(stage=2)
    train(engine)
    engine.save_checkpoint(tmp_path, tag="t")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        ckpt = tmp_path / f"{how}-{name}"
        shutil.copytree(tmp_path / "t", ckpt / "t")
        path = ckpt / "t" / name
        data = bytearray(path.read_bytes())
        if how == "flip":
            data[len(data) // 3] ^= 0x10
            path.write_bytes(bytes(data))
        elif how == "truncate":
            path.write_bytes(bytes(data[: len(data) // 2]))
        else:
            path.unlink()
        with pytest.raises(CheckpointError, match=f"checkpoint file {path} {message}"):
            engine.load_checkpoint(ckpt, tag="t")


def test_a_checkpoint_of_another_model_names_the_mismatching_parameters(tmp_path):
    src = engine_for()
    src.save_checkpoint(tmp_path)
    wider = engine_for(model_cfg=GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=1, n_embd=16, bias=False))
    with pytest.raises(
        CheckpointError,
        match=r"saved from a different model: shape mismatch: wte.weight "
        r"\(checkpoint \[64, 15\], model \[64, 16\]\)",
    ):
        wider.load_checkpoint(tmp_path)
    deeper = engine_for(model_cfg=GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=1, n_embd=15, bias=False))
    with pytest.raises(
        CheckpointError,
        match=r"missing from the checkpoint: blocks.1.ln_1.weight, "
        r"blocks.1.attn.qkv.weight",
    ):
        deeper.load_checkpoint(tmp_path)
    before = weights(deeper)
    deeper.load_checkpoint(tmp_path, load_module_strict=False)
    after = weights(deeper)
    assert torch.equal(after["wte.weight"], weights(src)["wte.weight"])
    assert torch.equal(after["blocks.1.mlp.fc.weight"], before["blocks.1.mlp.fc.weight"])


def test_another_optimizer_needs_load_optimizer_states_false(tmp_path):
    src = engine_for()
    train(src)
    src.save_checkpoint(tmp_path)
    sgd = engine_for(optimizer={"type": "SGD", "params": {"lr": 0.1}}, zero_allow_untested_optimizer=True)
    with pytest.raises(
        CheckpointError, match="holds AdamW optimizer state, this engine uses SGD; pass load_optimizer_states=False"
    ):
        sgd.load_checkpoint(tmp_path)
    sgd.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert_weights_equal(weights(src), weights(sgd))
    assert len(sgd.optimizer.state) == 0 and sgd.global_steps == 2


def test_load_module_only_leaves_the_optimizer_and_counters(tmp_path):
    src = engine_for(stage=2, bf16={"enabled": True})
    train(src)
    src.save_checkpoint(tmp_path)
    dst = engine_for(stage=2, seed=3, bf16={"enabled": True})
    dst.load_checkpoint(tmp_path, load_module_only=True)
    assert_weights_equal(weights(src), weights(dst))
    assert dst.global_steps == 0 and len(dst.optimizer.state) == 0
    # the masters follow the loaded (bf16) weights
    for e in dst.zero.shard_entries(parameter_names(dst.module)):
        for p in e.pieces:
            param = dst.module.get_parameter(p.name).detach().reshape(-1)
            assert torch.equal(
                e.master.view(-1)[p.offset : p.offset + p.numel],
                param[p.param_offset : p.param_offset + p.numel].float(),
            )


def test_client_state_cannot_overwrite_checkpoint_keys(tmp_path):
    with pytest.raises(ValueError, match=r"client_state keys \['global_steps', 'module'\] are reserved"):
        engine_for().save_checkpoint(tmp_path, client_state={"module": 1, "global_steps": 2, "ok": 3})
    assert not (tmp_path / "latest").exists()


def test_excluded_frozen_parameters_keep_their_current_values(tmp_path):
    src = engine_for()
    train(src)
    src.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    manifest = read_manifest(tmp_path / "global_step2")
    assert manifest["excluded_frozen"] == ["wpe.weight"]
    dst = engine_for(seed=9)
    frozen = dst.module.wpe.weight.detach().clone()
    dst.load_checkpoint(tmp_path)  # strict, yet the excluded frozen weight may be absent
    assert torch.equal(dst.module.wpe.weight, frozen)
    assert torch.equal(dst.module.wte.weight, src.module.wte.weight)


def test_resaving_a_tag_replaces_it_and_leaves_nothing_hidden(tmp_path):
    engine = engine_for()
    (tmp_path / ".t.partial").mkdir(parents=True)  # a save that crashed earlier
    (tmp_path / ".t.partial" / "junk").write_text("x")
    engine.save_checkpoint(tmp_path, tag="t", client_state={"v": 1})
    train(engine)
    engine.save_checkpoint(tmp_path, tag="t", client_state={"v": 2})
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]
    assert (tmp_path / "latest").read_text() == "t"
    assert engine.load_checkpoint(tmp_path)[1] == {"v": 2}


def test_a_save_killed_between_its_renames_loads_the_previous_copy(tmp_path, caplog):
    engine = engine_for()
    engine.save_checkpoint(tmp_path, tag="t", client_state={"v": 1})
    os.rename(tmp_path / "t", tmp_path / ".t.previous")  # the state between the two renames
    with caplog.at_level(logging.WARNING):
        path, client = engine_for(seed=2).load_checkpoint(tmp_path)
    assert client == {"v": 1} and path == str(tmp_path / ".t.previous" / "mp_rank_00_model_states.pt")
    assert "holds its previous complete copy" in caplog.text


def test_save_latest_false_keeps_latest(tmp_path):
    engine = engine_for()
    engine.save_checkpoint(tmp_path, tag="a")
    engine.save_checkpoint(tmp_path, tag="b", save_latest=False)
    assert (tmp_path / "latest").read_text() == "a" and (tmp_path / "b").is_dir()


def test_save_16bit_model_writes_compact_tensors_in_the_training_dtype(tmp_path):
    engine = engine_for(stage=2, bf16={"enabled": True})
    train(engine)
    assert engine.save_16bit_model(tmp_path / "out") is True
    sd = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert_weights_equal(sd, weights(engine))
    assert sd["wte.weight"].dtype == torch.bfloat16 and sd["lm_head.weight"] is not None
    n_bytes = sum(v.nbytes for k, v in sd.items() if k != "lm_head.weight")
    # views into the flat ZeRO buckets are written as their own small tensors, not whole buckets
    assert (tmp_path / "out" / "pytorch_model.bin").stat().st_size < n_bytes + 20_000
    assert sd["wte.weight"].untyped_storage().data_ptr() == sd["lm_head.weight"].untyped_storage().data_ptr()


def test_manifest_records_layout_and_checksums(tmp_path):
    engine = engine_for(stage=2)
    train(engine)
    engine.save_checkpoint(tmp_path)
    m = read_manifest(tmp_path / "global_step2")
    assert m["zero_stage"] == 2 and m["dp_world_size"] == 1 and m["zerospeed_version"] == zerospeed.__version__
    assert m["parallel_layout"] == {"data_parallel": 1, "tensor_parallel": 1, "pipeline_parallel": 1}
    assert set(m["files"]) == {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    assert all(len(r["sha256"]) == 64 for r in m["files"].values())
    assert m["parameters"]["wte.weight"] == {"shape": [64, 15], "dtype": "float32", "trainable": True}
    assert m["tied"] == {"lm_head.weight": "wte.weight"}
    pieces = [p for e in m["partition"][0]["entries"] for p in e["pieces"]]
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    assert sum(p[3] for p in pieces) == trainable
    assert all(
        e["elementwise"] == ["exp_avg", "exp_avg_sq"] and e["scalars"] == ["step"] for e in m["partition"][0]["entries"]
    )


def test_the_fp16_loss_scale_and_scheduler_are_restored(tmp_path):
    fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1}
    src = engine_for(stage=1, fp16=fp16)
    train(src, steps=3)
    assert src.loss_scale == 2.0**11  # doubled after each of the 3 clean steps
    src.save_checkpoint(tmp_path)
    dst = engine_for(stage=1, seed=4, fp16=fp16)
    dst.load_checkpoint(tmp_path)
    assert dst.loss_scale == 2.0**11 and dst.loss_scaler.state_dict() == src.loss_scaler.state_dict()
    assert dst.lr_scheduler.state_dict() == {"last_batch_iteration": 2} and dst.get_lr() == src.get_lr()
    dst_lr_only = engine_for(stage=1, seed=4, fp16=fp16)
    dst_lr_only.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert dst_lr_only.get_lr() == src.get_lr() and len(dst_lr_only.optimizer.state) == 0


def test_stage_3_save_load_and_16bit_model_in_one_process(tmp_path):
    src = engine_for(stage=3)
    src.save_checkpoint(tmp_path / "ckpt")
    dst = engine_for(stage=3, seed=4)
    dst.load_checkpoint(tmp_path / "ckpt")
    full_src, full_dst = src.zero.full_state_dict(), dst.zero.full_state_dict()
    assert full_src.keys() == full_dst.keys() and all(torch.equal(full_src[k], full_dst[k]) for k in full_src)
    src.save_16bit_model(tmp_path / "out")
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(saved[k], full_src[k]) for k in full_src)


@pytest.mark.parametrize("stage", [0, 3])
def test_save_16bit_model_can_exclude_frozen_parameters(tmp_path, stage):
    # DeepSpeed 0.19.8's signature: save_16bit_model(save_dir, save_filename="pytorch_model.bin",
    # exclude_frozen_parameters=False); excluded = the parameters with requires_grad False
    import zerospeed
    from zoo.models import TinyMLP

    torch.manual_seed(0)
    model = TinyMLP()
    list(model.parameters())[0].requires_grad_(False)  # the first layer's weight
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    engine, *_ = zerospeed.initialize(
        model=model,
        config={
            "train_batch_size": 2,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    engine.save_16bit_model(tmp_path / "all")
    engine.save_16bit_model(tmp_path / "trainable", exclude_frozen_parameters=True)
    everything = torch.load(tmp_path / "all" / "pytorch_model.bin", weights_only=True)
    trainable = torch.load(tmp_path / "trainable" / "pytorch_model.bin", weights_only=True)
    assert frozen and frozen <= everything.keys()
    assert trainable.keys() == everything.keys() - frozen


def test_saves_carry_the_universal_checkpoint_info_deepspeed_writes(tmp_path):
    # DeepSpeed 0.19.8's ds_to_universal refuses a tag without `universal_checkpoint_info`; for a plain model its
    # --inject_missing_state writes {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}, which
    # deepspeed/checkpoint/constants.py defines as below. A client's own value (Megatron-DeepSpeed's) wins and comes
    # back as client state; the injected one does not.
    reference = {"universal_checkpoint_version": 0.4}
    engine = engine_for(stage=2)
    train(engine, steps=1)
    engine.save_checkpoint(tmp_path / "plain", client_state={"epoch": 1})
    mine = {"universal_checkpoint_version": 0.2, "tensor_parallel_patterns": ["mlp"]}
    engine.save_checkpoint(tmp_path / "megatron", client_state={"universal_checkpoint_info": mine})
    saved = torch.load(tmp_path / "plain/global_step1/mp_rank_00_model_states.pt", weights_only=False)
    assert saved["universal_checkpoint_info"] == reference
    assert engine.load_checkpoint(tmp_path / "plain")[1] == {"epoch": 1}
    assert engine.load_checkpoint(tmp_path / "megatron")[1] == {"universal_checkpoint_info": mine}
