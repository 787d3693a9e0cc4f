"""The newer precision modes on a GPU (docs/precision.md), one rank: `torch_autocast` (bf16, the forward under
CUDA autocast) and bf16 masters with bf16 optimizer states, each at ZeRO 2 and 3, against plain PyTorch on
the same GPU: autocast around the same forward, and AdamW on a bf16 model. One rank, so no collective
rounds anything: losses within 1e-5 over 5 steps and final weights within 1e-5 (fp32 weights) or
exactly (bf16 weights). tests/dist/test_torch_autocast.py and test_bf16_masters.py check the
multi-rank reductions on the CPU.
"""

import pytest
import torch

from harness import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
STEPS, BATCH = 5, 4


def _model():
    from zoo.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())  # (untied: see the dist tests)
    return model


def _batches():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"]), generator=g) for _ in range(STEPS)]


def _engine_run(mode: str, stage: int):
    import zerospeed

    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if mode == "autocast":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bf16"}
    else:
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    losses = []
    for ids in _batches():
        ids = ids.cuda()
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return losses, weights


def _reference(mode: str):
    model = _model().cuda()
    if mode == "masters":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for ids in _batches():
        ids = ids.cuda()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "autocast"):
            loss = model(ids, ids)
        loss.backward()
        opt.step()
        losses.append(loss.float().item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _ranks():
    return {(mode, stage): _engine_run(mode, stage) for mode in ("autocast", "masters") for stage in (2, 3)} | {
        mode: _reference(mode) for mode in ("autocast", "masters")
    }


@pytest.mark.timeout(200)
def test_autocast_and_bf16_masters_train_like_plain_pytorch_on_the_gpu():
    (r,) = run_distributed(_ranks, 1, timeout=170, backend="nccl")
    for mode in ("autocast", "masters"):
        ref_losses, ref_weights = r[mode]
        for stage in (2, 3):
            losses, weights = r[mode, stage]
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (mode, stage, losses, ref_losses)
            for k, v in ref_weights.items():
                assert weights[k].dtype == v.dtype, (mode, stage, k)
                torch.testing.assert_close(weights[k].float(), v.float(), atol=1e-5, rtol=0, msg=f"{mode} {stage} {k}")
