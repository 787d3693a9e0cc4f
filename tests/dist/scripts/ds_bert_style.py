"""A client script in the shape of DeepSpeedExamples' HelloDeepSpeed BERT pre-training
(training/HelloDeepSpeed/train_bert_ds.py: a transformers RoBERTa masked-LM, `deepspeed.initialize(model=...,
model_parameters=..., config=ds_config)` with ZeRO-1, CPU optimizer offload and bf16, `model.backward` /
`model.step`, `save_checkpoint(exp_dir, client_state={"checkpoint_step": step})` every few steps and
`_, client_state = model.load_checkpoint(load_dir)` to resume), runnable UNCHANGED under real DeepSpeed
and under zerospeed's shim.

Differences from the tutorial, to make it a deterministic CPU test: a tiny RoBERTa config and synthetic
masked batches (fixed seed, 15% masked) instead of WikiText, no tokenizer or data loader, and rank 0
writing its per-step losses and a fingerprint of the trained weights to --loss_log.
"""

import argparse
import json

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers import RobertaConfig, RobertaForMaskedLM

VOCAB, SEQ, MICRO = 64, 16, 4


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--checkpoint_dir", type=str, required=True)
    p.add_argument("--load_checkpoint_dir", type=str, default=None)
    p.add_argument("--num_iterations", type=int, default=6)
    p.add_argument("--checkpoint_every", type=int, default=3)
    p.add_argument("--loss_log", type=str, default="")
    return p.parse_args()


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(4, VOCAB, (MICRO, SEQ), generator=g)
    labels = torch.full_like(ids, -100)
    mask = torch.rand(ids.shape, generator=g) < 0.15
    mask[:, 1] = True  # every row predicts at least one token
    labels[mask] = ids[mask]
    ids = ids.masked_fill(mask, 3)  # <mask>
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def main():
    args = get_args()
    deepspeed.init_distributed()
    torch.manual_seed(42)
    model = RobertaForMaskedLM(
        RobertaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=40,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    start_step = 1
    if args.load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=args.load_checkpoint_dir)
        start_step = client_state["checkpoint_step"] + 1
    device = get_accelerator().device_name(model.local_rank)
    rank = torch.distributed.get_rank()
    losses = {}
    for step in range(start_step, args.num_iterations + 1):
        data = {k: v.to(device) for k, v in batch(step, rank).items()}
        loss = model(**data).loss
        model.backward(loss)
        model.step()
        losses[step] = loss.item()
        if step % args.checkpoint_every == 0:
            model.save_checkpoint(save_dir=args.checkpoint_dir, client_state={"checkpoint_step": step})
    # a fingerprint of the trained (bf16) weights: the sum of each parameter, in float64
    weights = [float(p.detach().double().sum()) for p in model.module.parameters()]
    if rank == 0 and args.loss_log:
        with open(args.loss_log, "w") as f:
            json.dump({"losses": losses, "weights": weights}, f)


if __name__ == "__main__":
    main()
