"""A Hugging Face `Trainer` script as people write them (a tiny Llama from its config, token
ids as data, no dlaunch import). It prints the Trainer's own count of optimizer steps and of
the samples it trained on, which dlaunch's measurement is checked against."""

import argparse
import os
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(os.path.join(os.path.dirname(__file__), "llama-tiny"))
    model = AutoModelForCausalLM.from_config(config)
    batch, accum = 2, 2
    out = tempfile.mkdtemp(prefix="hf-trainer-")
    training = TrainingArguments(output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=accum, learning_rate=1e-3, logging_steps=1,
                                 report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                                 dataloader_num_workers=0)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(1024, args.seq_len, config.vocab_size))
    trainer.train()
    steps = trainer.state.global_step
    rank = int(os.environ.get("RANK", 0))
    print(f"trainer counted rank {rank}: {steps} steps, {steps * batch * accum} samples, "
          f"{steps * batch * accum * args.seq_len} tokens")


if __name__ == "__main__":
    main()
