"""Tensor-parallel checkpoints: saved at (tp 2, dp 2), resumed at another tp degree and data-parallel size
directly, and consolidated into a transformers `from_pretrained` directory — against one plain PyTorch run.

Two AutoTP models, each trained K steps at (tp 2, dp 2) and saved, then resumed N more steps from that
checkpoint in fresh engines at (tp 4, dp 1) and (tp 1, dp 4), at other ZeRO stages:

* Llama with grouped-query attention (4 query, 2 kv heads): at tp 4 each kv head is replicated on two
  ranks (ShardSpec.replicas), at tp 2 split; saved at ZeRO-1, resumed at ZeRO-3 (tp 4) and ZeRO-2 (tp 1).
* GPT-2 (fused Conv1D `c_attn`, stored [in, out], that AutoTP replaces by [out, in] Linear slices; the
  lm_head tied to the vocabulary-parallel embedding): saved at ZeRO-0, resumed at ZeRO-1 (tp 4), ZeRO-3
  (tp 1), and at the saved layout (tp 2, dp 2), where tp rank 0 copies its files as they are.

The reference is one uninterrupted plain-PyTorch run of K + N steps (torch.optim.AdamW, the global batch
in one forward, torch's clip_grad_norm_ with a clip that acts every step): the resumed losses must equal
its steps K.. within 1e-5, which needs the weights, the fp32 masters and Adam's exp_avg, exp_avg_sq and
step all restored. The GPT-2 checkpoint is also consolidated (zero_to_fp32's API), exported, and read by
GPT2LMHeadModel.from_pretrained: its logits equal those of the trained model's gathered weights.

One spawn of 4 ranks runs every engine (processes are the expensive part on two cores).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed

pytest.importorskip("transformers")

V, T, G, K, N, M, LR, WD, CLIP, WORLD = 37, 8, 4, 3, 3, 2, 1e-2, 0.01, 0.5, 4  # G: sequences per global batch


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=T,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
            use_cache=False,
        )
    )


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
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
            attn_implementation="eager",
            use_cache=False,
        )
    )


MODELS = {"llama": llama, "gpt2": gpt2}
# (tp, zero stage) of the saving run, then of each resumed run; dp = WORLD // tp
CHAINS = {"llama": [(2, 1), (4, 3), (1, 2)], "gpt2": [(2, 0), (4, 1), (1, 3), (2, 0)]}
# Llama's second hop: the (tp 4, ZeRO-3) run saves after its N steps (GQA kv heads replicated: each saved
# once), and (tp 2, dp 2, ZeRO-2) resumes from that for M more steps.
HOP = (2, 2)


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (G, T), generator=g) for _ in range(K + N + M)]


def _config(tp: int, stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": G // (WORLD // tp),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "tensor_parallel": {"autotp_size": tp},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _train(engine, steps) -> list[float]:
    """The global batch's loss per step (each dp rank's slice, averaged over the dp ranks)."""
    from zerospeed import comm

    mesh = engine.mesh
    dp, dp_rank = mesh.size("dp"), mesh.rank_in("dp")
    losses = []
    for ids in steps:
        mine = ids.chunk(dp)[dp_rank]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        comm.all_reduce(t, op="avg", group=mesh.group("dp"))
        losses.append(t.item())
    return losses


def _gathered(engine) -> dict:
    import zerospeed
    from zerospeed.parallel.tensor import full_state_dict

    with zerospeed.zero.GatheredParameters(list(engine.module.parameters())):
        return full_state_dict(engine.module, engine.mesh.group("tp"))


def _chains(root: str) -> dict:
    import zerospeed

    out = {}
    data = batches()
    for kind, chain in CHAINS.items():
        ckpt = f"{root}/{kind}"
        (tp, stage), resumes = chain[0], chain[1:]
        engine, *_ = zerospeed.initialize(model=MODELS[kind](), config=_config(tp, stage))
        out[kind, "saved"] = {"losses": _train(engine, data[:K]), "weights": _gathered(engine)}
        engine.save_checkpoint(ckpt)
        engine.save_16bit_model(f"{root}/{kind}_16bit")
        for i, (tp, stage) in enumerate(resumes):
            engine, *_ = zerospeed.initialize(model=MODELS[kind](), config=_config(tp, stage))
            engine.load_checkpoint(ckpt)
            out[kind, i] = {
                "losses": _train(engine, data[K : K + N]),
                "steps": engine.global_steps,
                "layout": (engine.mesh.size("tp"), engine.mesh.size("dp"), engine.zero.stage),
            }
            if kind == "llama" and i == 0:
                engine.save_checkpoint(f"{root}/llama_hop")
    engine, *_ = zerospeed.initialize(model=llama(), config=_config(*HOP))
    engine.load_checkpoint(f"{root}/llama_hop")
    out["llama", "hop"] = _train(engine, data[K + N :])
    # weights only, into another layout (tp 4): the module states' pieces, resliced
    engine, *_ = zerospeed.initialize(model=llama(), config=_config(4, 0))
    engine.load_checkpoint(f"{root}/llama", load_module_only=True)
    out["llama", "module_only"] = (_gathered(engine), engine.global_steps)
    return out


def reference(kind: str):
    """One plain process, K + N + M uninterrupted steps: (losses, state dict after K steps)."""
    model = MODELS[kind]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, after_k = [], None
    for step, ids in enumerate(batches()):
        if step == K:
            after_k = {k: v.clone() for k, v in model.state_dict().items()}
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)) > CLIP  # the clip acts
        opt.step()
        losses.append(loss.item())
    return losses, after_k


def _assert_state_close(got: dict, ref: dict, what: str) -> None:
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=lambda m, key=key: f"{what} {key}: {m}")


@pytest.mark.timeout(240)
def test_tp_checkpoint_resumes_at_other_tp_and_dp_and_consolidates(tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    from zerospeed.checkpoint import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
    )
    from zerospeed.checkpoint.cli import main as ckpt_cli
    from zerospeed.checkpoint.consolidate import resolve_checkpoint

    results = run_distributed(_chains, WORLD, str(tmp_path), timeout=220)
    for kind, chain in CHAINS.items():
        ref_losses, ref_after_k = reference(kind)
        for rank, res in enumerate(results):
            saved = res[kind, "saved"]["losses"]
            assert max(abs(a - b) for a, b in zip(saved, ref_losses[:K])) <= 1e-5, (kind, rank, saved, ref_losses)
            for i, (tp, stage) in enumerate(chain[1:]):
                got = res[kind, i]
                assert got["layout"] == (tp, WORLD // tp, stage) and got["steps"] == K + N
                diffs = [abs(a - b) for a, b in zip(got["losses"], ref_losses[K : K + N])]
                assert len(diffs) == N and max(diffs) <= 1e-5, (kind, got["layout"], rank, diffs)
            if kind == "llama":
                diffs = [abs(a - b) for a, b in zip(res["llama", "hop"], ref_losses[K + N :])]
                assert len(diffs) == M and max(diffs) <= 1e-5, ("second hop", rank, diffs)
                weights, steps = res["llama", "module_only"]
                assert steps == 0  # a module-only load leaves the training state alone
                _assert_state_close(weights, ref_after_k, "module-only load at tp 4:")

        tag_dir, manifest = resolve_checkpoint(tmp_path / kind)
        files = sorted(manifest["files"])
        assert "mp_rank_01_model_states.pt" in files and "zero_pp_rank_1_mp_rank_01_optim_states.pt" in files, files
        layout = manifest["parallel_layout"]
        assert (layout["tensor_parallel"], layout["data_parallel"]) == (2, 2)
        norm = "model.norm.weight" if kind == "llama" else "transformer.ln_f.weight"
        assert norm not in layout["shard_specs"]  # replicated: saved once, by tp rank 0
        mp1 = torch.load(tag_dir / "mp_rank_01_model_states.pt", weights_only=False)["module"]
        assert norm not in mp1 and mp1

        consolidated = get_fp32_state_dict_from_zero_checkpoint(tmp_path / kind)
        gathered = results[0][kind, "saved"]["weights"]
        assert set(consolidated) == set(ref_after_k)
        sixteen = torch.load(tmp_path / f"{kind}_16bit" / "pytorch_model.bin", weights_only=True)
        assert set(sixteen) == set(ref_after_k) and all(torch.equal(sixteen[k], gathered[k]) for k in sixteen)
        assert all(torch.equal(consolidated[k], gathered[k]) for k in gathered)  # the masters are the fp32 weights
        _assert_state_close(consolidated, ref_after_k, f"{kind} consolidated:")

    # the (tp 4, ZeRO-3) save: a kv head shared by tp ranks 0-1 (and 2-3) is in rank 0's (and 2's) files only
    _, hop = resolve_checkpoint(tmp_path / "llama_hop")
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    assert [s["replicas"] for s in hop["parallel_layout"]["shard_specs"][k_proj]["specs"]] == [2, 2, 2, 2]
    holders = {
        rf.get("tp_rank", 0) for rf in hop["partition"] for e in rf["entries"] for p in e["pieces"] if p[0] == k_proj
    }
    assert holders == {0, 2}, holders

    # the CLI reads a TP checkpoint too
    assert ckpt_cli(["inspect", str(tmp_path / "llama"), "--verify"]) == 0
    assert "tensor parallel 2 (" in capsys.readouterr().out
    assert ckpt_cli(["to-fp32", str(tmp_path / "llama"), str(tmp_path / "llama_fp32")]) == 0
    _assert_state_close(
        torch.load(tmp_path / "llama_fp32" / "pytorch_model.bin", weights_only=True),
        reference("llama")[1],
        "zerospeed-ckpt to-fp32:",
    )

    # GPT-2: the consolidated checkpoint as a transformers directory
    export = tmp_path / "gpt2_hf"
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "gpt2", export, safe_serialization=True)
    trained = gpt2()
    trained.config.save_pretrained(export)
    trained.load_state_dict(results[0]["gpt2", "saved"]["weights"], strict=True)
    loaded = GPT2LMHeadModel.from_pretrained(export)
    ids = batches()[0]
    torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, atol=1e-6, rtol=0)
