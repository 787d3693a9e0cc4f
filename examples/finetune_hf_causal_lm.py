"""Train a small GPT-2 (random init, byte vocabulary) with the transformers Trainer on zerospeed.

    zerospeed --num_gpus 2 examples/finetune_hf_causal_lm.py --deepspeed examples/configs/hf_zero2.json \
        --output_dir /tmp/out --max_steps 50 --logging_steps 10

The only zerospeed line is the import of `Trainer` and `TrainingArguments`; everything else is a
plain transformers script. The data is the Python standard library's source as bytes (no download,
no tokenizer). With a stage-3 config the model is built under `zero.Init`, so no rank ever holds
all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, GPT2Config, HfArgumentParser

import zerospeed
from zerospeed.integrations.hf_auto import load_hf_config
from zerospeed.integrations.transformers import Trainer, TrainingArguments
from zoo.data import ByteSequenceDataset, stdlib_corpus


@dataclass
class ModelArguments:
    n_layer: int = field(default=4, metadata={"help": "transformer blocks"})
    n_embd: int = field(default=128, metadata={"help": "hidden size"})
    n_head: int = field(default=4, metadata={"help": "attention heads"})
    seq_len: int = field(default=128, metadata={"help": "tokens (bytes) per example"})
    corpus_bytes: int = field(default=2_000_000, metadata={"help": "bytes of the stdlib corpus to use"})


class CausalBytes(torch.utils.data.Dataset):
    """Byte windows as Trainer examples: `labels` = `input_ids` (the model shifts them)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.windows = ByteSequenceDataset(tokens, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = self.windows[i]
        return {"input_ids": x, "labels": x}


def build_model(m: ModelArguments, args: TrainingArguments):
    config = GPT2Config(
        n_layer=m.n_layer,
        n_embd=m.n_embd,
        n_head=m.n_head,
        vocab_size=256,
        n_positions=m.seq_len,
        bos_token_id=0,
        eos_token_id=0,
    )
    stage3 = bool(args.deepspeed) and load_hf_config(args.deepspeed).get("zero_optimization", {}).get("stage") == 3
    with zerospeed.zero.Init(config_dict_or_path=args.deepspeed, enabled=stage3):
        return AutoModelForCausalLM.from_config(config)


def main() -> None:
    model_args, args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    tokens = stdlib_corpus(max_bytes=model_args.corpus_bytes)
    split = int(len(tokens) * 0.98)
    train = CausalBytes(tokens[:split], model_args.seq_len)
    evaluation = CausalBytes(tokens[split:], model_args.seq_len)
    torch.manual_seed(args.seed)
    trainer = Trainer(model=build_model(model_args, args), args=args, train_dataset=train, eval_dataset=evaluation)
    result = trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        logged = (
            f"first logged {losses[0]:.4f}, last logged {losses[-1]:.4f}, "
            if losses
            else "(none logged: raise --max_steps or lower --logging_steps) "
        )
        print(
            f"train loss: {logged}mean {result.training_loss:.4f}; eval loss {metrics['eval_loss']:.4f}; "
            f"{float(result.metrics['train_runtime']):.1f}s for {result.global_step} steps"
        )


if __name__ == "__main__":
    main()
