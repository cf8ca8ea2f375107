"""Tiny real models from ``transformers`` configs (random weights, no download) and
their data, shared by the Trainer and Accelerate tests and their rank modules.

- GPT-2 (``GPT2LMHeadModel``): the language-model head is tied to the token embedding;
- BERT (``BertForSequenceClassification``): the pooler feeds the classifier.
"""

from __future__ import annotations

import os
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded

VOCAB, LENGTH = 64, 16


def quiet() -> None:
    """transformers' and accelerate's logging to errors only (the Trainer logs every
    step)."""
    from transformers import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB,
                        n_positions=LENGTH, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        initializer_range=0.2)  # gradient norms above 1: clipping is active
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=LENGTH, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


MODELS = {"gpt2": gpt2, "bert": bert}


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``size`` random sequences, the same on every run: language modelling (GPT-2,
    labels are the inputs) or 3-way classification (BERT)."""

    def __init__(self, kind: str, size: int = 48) -> None:
        self.kind = kind
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=generator)
        if self.kind == "gpt2":
            return {"input_ids": ids, "labels": ids}
        return {"input_ids": ids, "labels": torch.tensor(index % 3)}


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}
