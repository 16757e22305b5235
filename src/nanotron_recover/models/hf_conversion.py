"""Conversion between this engine's checkpoints and Hugging Face ``LlamaForCausalLM`` folders.

Parameter names are already Hugging Face's, so converting is reading full tensors from one side and
writing them on the other. From HF, the weights are written as a single-shard (tp=1, pp=1)
checkpoint without optimizer state, which loads into any layout. To HF, each full tensor is
reassembled from whatever layout the checkpoint was saved with.

Both directions run in one process and never start torch.distributed, so there is no process group
to tear down. Every bad input (a folder that is not a LLaMA model, unreadable weights, a checkpoint
that does not match the config, an output path that is a file) is a one-line
:class:`~nanotron_recover.checkpoint.CheckpointError` naming the file, found before anything is written.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..checkpoint import CheckpointError, CheckpointReader, full_model_specs, save_checkpoint
from ..config import Config, LlamaConfig
from .llama import LlamaStage

HF_CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
)


def hf_config_dict(cfg: LlamaConfig, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": cfg.hidden_act,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.kv_heads,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "initializer_range": cfg.initializer_range,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }


def _one_line(error: BaseException) -> str:
    """An exception's message with its newlines folded, so that every error stays one line."""
    return " ".join(str(error).split()) or type(error).__name__


def _read_hf_config(folder: Path) -> dict:
    """``folder/config.json`` as a dict, or a one-line CheckpointError naming the file."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file}: not a readable JSON file ({_one_line(e)})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got {type(hf).__name__}")
    return hf


def _check_hf_config(hf: dict, cfg: LlamaConfig, where: Path) -> None:
    if hf.get("model_type") != "llama":
        raise CheckpointError(f"{where}: model_type is {hf.get('model_type')!r}, expected 'llama'")
    # transformers >= 5 writes rope_theta (and the rope type) inside rope_parameters.
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{where}: rope_parameters is not a mapping in config.json")
    for key in HF_CONFIG_KEYS:
        ours = getattr(cfg, key)
        theirs = hf.get(key, False if key == "tie_word_embeddings" else None)
        if key == "rope_theta" and theirs is None:
            theirs = rope.get("rope_theta")
        if theirs != ours:
            raise CheckpointError(f"{where}: {key}={theirs} in config.json but {ours} in the YAML config")
    if (hf.get("num_key_value_heads") or hf["num_attention_heads"]) != cfg.kv_heads:
        raise CheckpointError(f"{where}: num_key_value_heads differs from the YAML config")
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{where}: rope_scaling is not supported")


def _read_hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            try:
                with safe_open(f, framework="pt") as handle:
                    for key in handle.keys():
                        tensors[key] = handle.get_tensor(key)
            except Exception as e:  # safetensors raises its own error types for a damaged file
                raise CheckpointError(f"{f}: unreadable safetensors file ({_one_line(e)})") from None
        return tensors
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise CheckpointError(f"{folder}: no *.safetensors or pytorch_model*.bin weights")
    for f in bins:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated zip, foreign pickle, ...
            raise CheckpointError(f"{f}: unreadable PyTorch weights file ({_one_line(e)})") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{f}: expected a state dict, got {type(state).__name__}")
        tensors.update(state)
    return tensors


def _check_output_folder(out: Path) -> None:
    """Refuse an output path that cannot become a folder before any work is done."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file, not a folder: choose another --out")


def from_hf(hf_dir: str | Path, cfg: Config, out: str | Path) -> Path:
    """Write a (tp=1, pp=1) checkpoint of the HF model in ``hf_dir``; single process."""
    hf_dir = Path(hf_dir)
    mcfg = cfg.model.model_config
    _check_hf_config(_read_hf_config(hf_dir), mcfg, hf_dir)
    _check_output_folder(Path(out))
    tensors = _read_hf_tensors(hf_dir)
    # Built on the CPU directly: Module.to_empty() from "meta" would untie a tied lm_head.
    stage = LlamaStage(mcfg, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for name, param in stage.named_parameters():
            if name not in tensors:
                raise CheckpointError(f"{hf_dir}: missing tensor {name}")
            if not isinstance(tensors[name], torch.Tensor):
                raise CheckpointError(f"{hf_dir}: {name} is a {type(tensors[name]).__name__}, not a tensor")
            if tuple(tensors[name].shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{hf_dir}: {name} has shape {tuple(tensors[name].shape)}, expected {tuple(param.shape)}"
                )
            if not tensors[name].is_floating_point():
                raise CheckpointError(f"{hf_dir}: {name} has dtype {tensors[name].dtype}, expected floats")
            param.copy_(tensors[name].float())
    one_rank = replace(
        cfg, parallelism=replace(cfg.parallelism, dp=1, tp=1, pp=1), model=replace(cfg.model, dtype="float32")
    )
    return save_checkpoint(out, 0, one_rank, stage, None, tp=1, pp=1, dp_rank=0)


def to_hf(checkpoint: str | Path, cfg: Config, out: str | Path) -> Path:
    """Write a Hugging Face folder (config.json + model.safetensors) from a checkpoint of any layout."""
    reader = CheckpointReader(checkpoint)
    mcfg = cfg.model.model_config
    reader.check_model(mcfg)
    reader.verify()  # every shard opens and holds what meta.json lists, before anything is written
    out = Path(out)
    _check_output_folder(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"--out {out}: cannot create the folder ({_one_line(e)})") from None
    tensors = {name: reader.full(name).contiguous() for name in full_model_specs(mcfg)}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config_dict(mcfg, dtype), indent=2))
    return out


__all__ = ["from_hf", "hf_config_dict", "to_hf"]
