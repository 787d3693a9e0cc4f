"""Ulysses switched on by the config alone in the zerospeed Trainer, against one plain PyTorch process.

The Trainer gets `"sequence_parallel_size": P` in its DeepSpeed config and nothing else changes: a
GQA Llama (4 query / 2 kv heads), 13-token right-padded sequences with -100 labels, 2 accumulation
steps. The reference is stock `LlamaForCausalLM` in one process with torch's AdamW: per optimizer step,
the cross-entropy summed over every non-ignored (shifted) label of the step's batches, divided by their
count — the Trainer's `average_tokens_across_devices` semantics. Which batches a step takes follows from
accelerate's sequential sharding (rank r's k-th batch is global batch k*W + r) and DeepSpeed's adapter
(the P ranks of a sequence group take their P batches one after another). fp32, <= 1e-5.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from harness import run_distributed

pytest.importorskip("transformers")

SEQ, MICRO, GAS, STEPS, LR, WORLD = 13, 2, 2, 2, 1e-3, 4


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(7)
        self.rows = []
        for _ in range(n):
            ids = torch.randint(1, 64, (SEQ,), generator=g)
            labels, mask = ids.clone(), torch.ones_like(ids)
            labels[torch.rand(SEQ, generator=g) < 0.15] = -100
            pad = int(torch.randint(0, 6, (), generator=g))
            if pad:
                ids[SEQ - pad :], labels[SEQ - pad :], mask[SEQ - pad :] = 0, -100, 0
            self.rows.append({"input_ids": ids, "labels": labels, "attention_mask": mask})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _config(sp: int, stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "sequence_parallel_size": sp,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def n_samples() -> int:
    return STEPS * GAS * WORLD * MICRO


def _train(cases, out: str):
    sys.modules["deepspeed"] = None  # the integration must not need the deepspeed package
    import zerospeed
    from zerospeed.integrations.transformers import Trainer, TrainingArguments
    from zerospeed.sequence.hf import UlyssesSPAttentionHF

    results = {}
    for sp, stage in cases:
        args = TrainingArguments(
            output_dir=f"{out}/sp{sp}",
            deepspeed=_config(sp, stage),
            max_steps=STEPS,
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=GAS,
            learning_rate=LR,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            logging_steps=1,
            report_to=[],
            seed=0,
            disable_tqdm=True,
            save_strategy="no",
            train_sampling_strategy="sequential",
            max_grad_norm=0.0,
        )
        model = llama()
        trainer = Trainer(model=model, args=args, train_dataset=Samples(n_samples()))
        try:
            trainer.train()
        finally:
            UlyssesSPAttentionHF.unregister_from_transformers()
        with zerospeed.zero.GatheredParameters(list(model.parameters())):
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        results[(sp, stage)] = {
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "weights": weights,
        }
    return results


def step_batches(sp: int, step: int) -> list[int]:
    """The global batch indices (of MICRO samples each) optimizer step `step` trains on."""
    out = []
    for d in range(WORLD // sp):
        for m in range(step * GAS, (step + 1) * GAS):
            refill, j = divmod(m, sp)
            out.append(refill * WORLD + d * sp + j)
    return out


def reference(sp: int):
    model = llama()
    data = Samples(n_samples())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        total, count = 0.0, 0
        for b in step_batches(sp, step):
            rows = [data[i] for i in range(b * MICRO, (b + 1) * MICRO)]
            ids = torch.stack([r["input_ids"] for r in rows])
            labels = torch.stack([r["labels"] for r in rows])
            mask = torch.stack([r["attention_mask"] for r in rows])
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            target = labels[:, 1:]
            total = total + F.cross_entropy(
                logits.reshape(-1, 64), target.reshape(-1), ignore_index=-100, reduction="sum"
            )
            count += int((target != -100).sum())
        loss = total / count
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.timeout(400)
def test_trainer_turns_ulysses_on_from_the_config(tmp_path):
    cases = [(2, 2), (4, 3)]  # (sp, ZeRO stage): sp 2 x dp 2 at ZeRO-2, sp 4 at ZeRO-3
    results = run_distributed(_train, WORLD, cases, str(tmp_path), timeout=360)
    for sp, stage in cases:
        ref_losses, ref_weights = reference(sp)
        got = results[0][(sp, stage)]
        assert len(got["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(got["losses"], ref_losses)) <= 1e-5, (sp, got["losses"], ref_losses)
        for key, value in ref_weights.items():
            torch.testing.assert_close(
                got["weights"][key], value, atol=1e-5, rtol=0, msg=lambda m, key=key: f"sp {sp} {key}: {m}"
            )
