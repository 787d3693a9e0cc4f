"""Shard-on-load for training: a model built on the meta device, sharded and filled by
`zerospeed.tp_model_init(model, 2, checkpoint=...)` with only this rank's slices, then trained by the
engine (`"tensor_parallel": {"autotp_size": 2}`), against the plain transformers model loaded by
`from_pretrained` in one process.

GPT-2 (Conv1D weights stored [in, out], fused c_attn, a tied head saved once, an uneven vocabulary
split; given as a list of files) and a GQA Llama (rotary buffers no checkpoint holds; saved in several
files with an index, given as the directory) at tp 2: 6 AdamW steps, losses within 1e-5 and the
gathered weights equal the reference's. The loaded parameters are ordinary leaves with requires_grad;
GPT-2's head and embedding are one vocabulary-sharded parameter. A meta model reaching `initialize`,
or `tp_model_init` without a checkpoint, is an error naming the fix.

Memory: for a 76 MiB Llama saved in 20 MB files (given as its index file), the peak growth of each
rank's anonymous resident memory (sampled every 0.5 ms from /proc, independent of the loader, as in
test_inference_shard_load.py) during `tp_model_init` must stay under (model / tp + largest tensor) x 1.1;
it is measured first in each process, so no memory freed by earlier work can hide growth. And the
forms `checkpoint` takes (directory, index file, list of files) resolve to the files the index names.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.rss import PeakSampler

pytest.importorskip("transformers")

V, T, MICRO, STEPS, LR, TP = 37, 8, 2, 6, 1e-2, 2
# Note: GPT-2's key bias has an analytic gradient of zero (softmax ignores a constant shift), so its computed
# gradient is rounding noise that Adam's default eps would turn into lr-sized steps; eps 1e-4 keeps it quiet.
EPS = 1e-4


def config(arch: str):
    from transformers import GPT2Config, LlamaConfig

    if arch == "gpt2":
        return GPT2Config(
            vocab_size=V,
            n_positions=T,
            n_embd=16,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
        )
    if arch == "big":
        return LlamaConfig(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=T,
        )
    return LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (MICRO, T), generator=g) for _ in range(STEPS)]


def _meta_model(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), attn_implementation="sdpa")


def _train_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "gradient_accumulation_steps": 1,
        "tensor_parallel": {"autotp_size": TP},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0}},
    }


def _worker(sources):
    import safetensors.torch  # noqa: F401  (imported before the measurement starts)

    import zerospeed
    from zerospeed.parallel.tensor import full_state_dict

    zerospeed.init_distributed()
    out = {}
    directory, checkpoint = sources["big"]
    big = _meta_model(directory)
    with PeakSampler() as peak:
        zerospeed.tp_model_init(big, TP, torch.float32, checkpoint=checkpoint)
    out["peak"] = peak.growth_bytes
    del big
    for arch in ("gpt2", "llama"):
        directory, checkpoint = sources[arch]
        model = zerospeed.tp_model_init(_meta_model(directory), TP, torch.float32, checkpoint=checkpoint)
        params = list(model.parameters())
        out[arch + "_leaves"] = all(
            type(p) is torch.nn.Parameter and p.is_leaf and p.requires_grad and not p.is_meta for p in params
        )
        if arch == "gpt2":
            out["tied"] = model.lm_head.weight is model.transformer.wte.weight
            out["wte_rows"] = model.transformer.wte.weight.shape[0]
        engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=_train_config())
        losses = []
        for ids in batches():
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[arch] = losses
        out[arch + "_weights"] = full_state_dict(model, engine.mesh.group("tp"))
    try:
        zerospeed.initialize(model=_meta_model(sources["llama"][0]), config=_train_config())
    except zerospeed.ConfigError as e:
        out["initialize_meta"] = str(e)
    try:
        zerospeed.tp_model_init(_meta_model(sources["llama"][0]), TP)
    except ValueError as e:
        out["no_checkpoint"] = str(e)
    return out


def reference(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.timeout(120)
def test_meta_model_shard_on_load_trains_like_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    sources = {}
    for arch, shard in (("gpt2", None), ("llama", 8_000), ("big", "20MB")):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config(arch))
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(tmp_path / arch, **kwargs)
        sources[arch] = (str(tmp_path / arch), str(tmp_path / arch))
        if arch == "big":
            sizes = [p.numel() * 4 for p in model.parameters()]
            bound = (sum(sizes) / TP + max(sizes)) * 1.1
        del model
    assert len(list((tmp_path / "llama").glob("*.safetensors"))) > 1
    assert len(list((tmp_path / "big").glob("*.safetensors"))) > 1
    sources["gpt2"] = (sources["gpt2"][0], [str(tmp_path / "gpt2" / "model.safetensors")])  # a list of files
    sources["big"] = (sources["big"][0], str(tmp_path / "big" / "model.safetensors.index.json"))  # an index

    results = run_distributed(_worker, TP, sources, timeout=100)
    for arch in ("gpt2", "llama"):
        ref_losses, ref_weights = reference(str(tmp_path / arch))
        for rank, res in enumerate(results):
            assert res[arch + "_leaves"], f"{arch} rank {rank}: a loaded parameter is not a trainable leaf"
            diff = max(abs(a - b) for a, b in zip(res[arch], ref_losses))
            assert diff <= 1e-5, f"{arch} rank {rank}: {res[arch]} vs {ref_losses}"
            for key, value in ref_weights.items():
                torch.testing.assert_close(
                    res[arch + "_weights"][key],
                    value,
                    atol=1e-5,
                    rtol=0,
                    msg=lambda m, a=arch, r=rank, k=key: f"{a} rank {r} {k}: {m}",
                )
    for rank, res in enumerate(results):
        assert res["tied"] and res["wte_rows"] == (19 if rank == 0 else 18)  # 37 rows split 19 | 18, once
        assert "tp_model_init(model, 2, checkpoint=" in res["initialize_meta"]
        assert "checkpoint=" in res["no_checkpoint"] and "meta device" in res["no_checkpoint"]
        assert res["peak"] < bound, f"rank {rank}: peak {res['peak'] / 2**20:.1f} MiB >= {bound / 2**20:.1f} MiB"
        print(
            f"rank {rank}: load peak {res['peak'] / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB, "
            f"model {sum(sizes) / 2**20:.1f} MiB"
        )


def test_checkpoint_forms_resolve_to_safetensors_files(tmp_path):
    from safetensors.torch import save_file

    from zerospeed.config import ConfigError
    from zerospeed.parallel.tensor.load import safetensors_files

    for name in ("a.safetensors", "b.safetensors", "stray.safetensors"):
        save_file({"w": torch.zeros(1)}, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}'
    )
    want = [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    assert safetensors_files(tmp_path) == want  # the index's files, not every file in the directory
    assert safetensors_files(tmp_path / "model.safetensors.index.json") == want
    assert safetensors_files([str(tmp_path / "stray.safetensors")]) == [str(tmp_path / "stray.safetensors")]
    with pytest.raises(ConfigError, match="does not exist"):
        safetensors_files(tmp_path / "missing")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="no .safetensors files"):
        safetensors_files(tmp_path / "bin")
