"""A tiny random Hugging Face LLaMA and the matching YAML config, shared by the conversion and
evaluation tests (built locally, never downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers.mpirun_utils import REPO

MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
VOCAB = MODEL["vocab_size"]


def write_config(path: Path, tie: bool) -> Path:
    """The repo's tiny CPU config with this model, one rank (``--set`` picks tp/pp)."""
    data = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    data["model"]["model_config"].update(MODEL, tie_word_embeddings=tie)
    data["parallelism"].update(dp=1, tp=1, pp=1)
    data["tokens"].update(
        sequence_length=16, micro_batch_size=2, batch_accumulation_per_replica=1, train_steps=1
    )
    # A warm-up longer than the one training step is refused.
    data["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    path.write_text(yaml.safe_dump(data))
    return path


def save_random_hf_model(out: Path, tie: bool, seed: int) -> Path:
    """A fp32 HF LLaMA with every weight random (norms near 1), so logits are far from uniform."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**MODEL, tie_word_embeddings=tie)).float()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
                else:
                    param.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return out
