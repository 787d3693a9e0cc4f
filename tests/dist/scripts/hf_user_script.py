"""The fine-tuning script DeepSpeed users start from (../shared/user_script.md), in its shape:
`import deepspeed`, a causal LM and its tokenizer, a tokenized dataset padded to max length,
`TrainingArguments(..., deepspeed="./ds_config.json")` and the stock `transformers.Trainer`.

What differs from the tutorial script, and why:
- no model hub here: a small Llama is built from a config, and the tokenizer is a word-level one
  trained on local text (the `tokenizers` library, as `AutoTokenizer` would load it);
- `fp16=True` is off: transformers itself refuses fp16 on a CPU-only machine;
- `tokenizer=` is `processing_class=` (transformers 5 removed the old keyword);
- the reference run (no DS_CONFIG, under torchrun) sets `use_cpu=True`: on a machine without a GPU
  accelerate forms a multi-process (gloo, DDP) state only when told it runs on the CPU;
- sizes and steps are tiny, the optimizer is SGD without clipping (so any wrong gradient scale shows
  in the losses), and the log history is written to LOG for the test to compare.

Environment: DS_CONFIG (a path, or unset for the plain DDP reference run), OUT, LOG, PEFT=1 for a
LoRA adapter (peft), MAX_STEPS, ZERO_INIT=1 (the arguments made before the model, so that under
ZeRO-3 transformers builds it inside deepspeed.zero.Init), SAVE_INIT / LOAD_INIT (a file of the
initial weights, written by one run and started from by another).
"""

import json
import os

import torch
from transformers import (
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

if os.environ.get("DS_CONFIG"):
    import deepspeed  # noqa: F401  (as in the tutorial: often unused directly)

TEXT = (
    "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat and "
    "a bird sings in the old tree near the river where children play every summer day"
).split()


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(TEXT))}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.pad_token = fast.eos_token
    return fast


class Lines(torch.utils.data.Dataset):
    """Sentences of different lengths, tokenized with padding="max_length", truncation=True."""

    def __init__(self, tok, n=64, max_length=16):
        g = torch.Generator().manual_seed(1)
        lines = []
        for _ in range(n):
            start = int(torch.randint(0, len(TEXT) - 4, (1,), generator=g))
            length = int(torch.randint(3, 14, (1,), generator=g))
            lines.append(" ".join(TEXT[start : start + length]))
        self.enc = tok(lines, padding="max_length", truncation=True, max_length=max_length)

    def __len__(self):
        return len(self.enc["input_ids"])

    def __getitem__(self, i):
        return {k: self.enc[k][i] for k in ("input_ids", "attention_mask")}


def build_model(tok):
    """A small Llama (GQA: 4 heads, 2 KV heads) from a config, as `from_pretrained` would give one
    (under ZeRO-3 with the TrainingArguments made first, transformers builds it inside zero.Init)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )


def main():
    tok = tokenizer()
    if os.environ.get("ZERO_INIT") == "1":  # transformers' rule for ZeRO-3: the arguments before the model
        args = arguments()
    model = build_model(tok)
    if os.environ.get("LOAD_INIT"):  # start from another run's initial weights (the zero.Init run's)
        model.load_state_dict(torch.load(os.environ["LOAD_INIT"]), strict=False)
    if os.environ.get("PEFT") == "1":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM"),
        )
    if os.environ.get("ZERO_INIT") != "1":
        args = arguments()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Lines(tok),
        processing_class=tok,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
    )
    before = {n: _full(p).clone() for n, p in model.named_parameters()}  # collective
    sharded = sum(p.numel() for p in model.parameters()) < sum(t.numel() for t in before.values())
    if os.environ.get("SAVE_INIT") and trainer.args.process_index == 0:
        torch.save(before, os.environ["SAVE_INIT"])
    trainer.train()
    if os.environ.get("PEFT") == "1":
        trainer.save_model(os.environ["OUT"] + "/adapter")
    changed = sorted(n for n, p in model.named_parameters() if _full(p).ne(before[n]).any())  # collective
    if trainer.args.process_index == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(os.environ["LOG"], "w") as f:
            json.dump({"losses": losses, "changed": changed, "built_sharded": sharded}, f)


def arguments():
    return TrainingArguments(
        output_dir=os.environ["OUT"],
        num_train_epochs=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        warmup_steps=2,
        logging_steps=1,
        save_steps=500,
        max_steps=int(os.environ.get("MAX_STEPS", "6")),
        learning_rate=0.1,
        optim="sgd",
        max_grad_norm=0.0,
        weight_decay=0.0,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_drop_last=True,
        deepspeed=os.environ.get("DS_CONFIG") or None,
        use_cpu=not os.environ.get("DS_CONFIG") and not torch.cuda.is_available(),
    )


def _full(p):
    """The parameter's full value (under ZeRO-3 a shard of it lives on each rank)."""
    if os.environ.get("DS_CONFIG"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.detach().clone()
    return p.detach()


if __name__ == "__main__":
    main()
