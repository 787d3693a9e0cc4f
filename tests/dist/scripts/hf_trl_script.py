"""TRL's SFTTrainer or DPOTrainer, unchanged, with a DeepSpeed config (the shim makes it zerospeed).

A TRL user's script in its usual shape: a causal LM and tokenizer, a `datasets.Dataset`, the TRL
config with `deepspeed=...`, `trainer.train()`. No `import deepspeed` anywhere: TRL and accelerate
find the shim themselves. A tiny Llama and a word-level tokenizer stand in for hub models.

Environment: TRAINER=sft|dpo, DS_CONFIG, OUT, LOG (the log history as JSON, written by rank 0).
"""

import json
import os

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = (
    "the quick brown fox jumps over lazy dog cat sleeps on warm mat bird sings in old tree "
    "near river where children play every summer day good bad yes no"
).split()


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, **{w: i + 3 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", bos_token="<s>")
    fast.pad_token = fast.eos_token
    return fast


def model(tok):
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id,
        )
    )


def sentences(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, len(WORDS) - 4, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g)
        out.append(" ".join(WORDS[i] for i in idx.tolist()))
    return out


COMMON = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=1,
    max_steps=10,
    logging_steps=1,
    report_to=[],
    disable_tqdm=True,
    seed=0,
    save_strategy="no",
    bf16=False,
    fp16=False,
)


def run_sft(tok, out):
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": sentences(80, 1)})
    args = SFTConfig(output_dir=out, learning_rate=1e-2, max_length=16, deepspeed=os.environ["DS_CONFIG"], **COMMON)
    trainer = SFTTrainer(model=model(tok), args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    return trainer


def run_dpo(tok, out):
    from trl import DPOConfig, DPOTrainer

    prompts = sentences(80, 2)
    data = Dataset.from_dict(
        {"prompt": prompts, "chosen": ["yes good"] * len(prompts), "rejected": ["no bad"] * len(prompts)}
    )
    args = DPOConfig(
        output_dir=out, learning_rate=1e-2, beta=0.1, max_length=24, deepspeed=os.environ["DS_CONFIG"], **COMMON
    )
    # the reference model is passed (a copy of the start): TRL would otherwise reload it from the hub id
    trainer = DPOTrainer(model=model(tok), ref_model=model(tok), args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    return trainer


def main():
    tok = tokenizer()
    trainer = {"sft": run_sft, "dpo": run_dpo}[os.environ["TRAINER"]](tok, os.environ["OUT"])
    if trainer.args.process_index == 0:
        with open(os.environ["LOG"], "w") as f:
            json.dump({"history": trainer.state.log_history, "engine": type(trainer.model_wrapped).__module__}, f)


if __name__ == "__main__":
    main()
