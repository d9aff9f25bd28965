"""Fine-tune a Hugging Face causal LM with the `Trainer`, on zero3: `Zero3Trainer` and a DeepSpeed config.

The usual Hugging Face script with one line changed: `Zero3Trainer(..., zero3_config=...)` where it
had `Trainer(...)` and `TrainingArguments(deepspeed=...)`. The config is DeepSpeed's ZeRO-3 template,
`"auto"` values and all; the Trainer's arguments fill them. Nothing is downloaded: the model is a small
`LlamaConfig` built here (or `--model DIR`, a local Hugging Face model directory), and the data is
zero3's built-in character corpus.

    python examples/hf_trainer.py --out /tmp/hf-run                           # a world of one
    torchrun --nproc_per_node 2 examples/hf_trainer.py --out /tmp/hf-run      # two ranks
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py --out /tmp/hf-run

The output directory ends with `model.safetensors` and `config.json` (a plain `from_pretrained` loads
them) and `checkpoint-N/` directories that `--resume` continues from, bit-exactly.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from zero3.data import CharTokenizer, load_corpus
from zero3.integrations.hf import Zero3Trainer

# DeepSpeed's ZeRO-3 template as Hugging Face documents it: the Trainer fills every "auto".
ZERO3_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def corpus_rows(seq_len: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """The built-in corpus cut into rows of `seq_len + 1` characters (inputs and their labels)."""
    text = load_corpus()
    tokenizer = CharTokenizer(text)
    tokens = tokenizer.encode(text)
    rows = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)
    return [{"input_ids": row, "labels": row.clone()} for row in rows], tokenizer.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description="Fine-tune a causal LM with Zero3Trainer (Hugging Face's Trainer on zero3).")
    parser.add_argument("--out", required=True, help="output directory (checkpoints and the final model)")
    parser.add_argument("--model", default=None, help="a local Hugging Face model directory (default: a small Llama)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per rank per micro-step (default: %(default)s)")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-steps per optimizer step (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per row (default: %(default)s)")
    parser.add_argument("--bf16", action="store_true", help="compute in bf16")
    parser.add_argument("--save-steps", type=int, default=10, help="a checkpoint every N steps (default: %(default)s)")
    parser.add_argument("--resume", default=None, help="a checkpoint-N directory to continue from")
    options = parser.parse_args()

    rows, vocab = corpus_rows(options.seq_len)
    torch.manual_seed(0)
    if options.model is not None:
        model = LlamaForCausalLM.from_pretrained(options.model)
    else:
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=options.seq_len,
        ))
    args = TrainingArguments(
        output_dir=options.out, per_device_train_batch_size=options.micro_batch,
        gradient_accumulation_steps=options.accumulation, max_steps=options.steps, learning_rate=3e-3,
        weight_decay=0.01, warmup_steps=2, lr_scheduler_type="cosine", max_grad_norm=1.0, bf16=options.bf16,
        logging_steps=1, save_strategy="steps", save_steps=options.save_steps, report_to=[], seed=0,
    )
    trainer = Zero3Trainer(model=model, args=args, train_dataset=rows, zero3_config=ZERO3_CONFIG)
    trainer.train(resume_from_checkpoint=options.resume)
    trainer.save_model(options.out)


if __name__ == "__main__":
    main()
