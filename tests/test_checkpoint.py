"""Checkpoint format (single process): asynchronous saves equal synchronous ones, publication is
atomic, and a save interrupted before it is published leaves the previous checkpoint in force."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from nanotron_recover.checkpoint import CheckpointReader, PendingSave, latest_step, resolve, save_checkpoint
from nanotron_recover.config import Config, LlamaConfig, ModelArgs
from nanotron_recover.models.llama import LlamaStage


def tiny() -> tuple[Config, LlamaStage]:
    mcfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=64,
        max_position_embeddings=32,
    )
    cfg = Config(model=ModelArgs(model_config=mcfg, dtype="float32"))
    stage = LlamaStage(mcfg)
    stage.init_weights(0.02, seed=3)
    return cfg, stage


def opt_state(stage: LlamaStage) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        n: {"exp_avg": torch.randn(p.shape, generator=g), "exp_avg_sq": torch.rand(p.shape, generator=g)}
        for n, p in stage.named_parameters()
    }


def test_async_save_equals_sync_save(tmp_path):
    cfg, stage = tiny()
    state = opt_state(stage)
    sync = save_checkpoint(tmp_path / "a", 4, cfg, stage, state, tp=1, pp=1, dp_rank=0)
    pending = save_checkpoint(tmp_path / "b", 4, cfg, stage, state, tp=1, pp=1, dp_rank=0, asynchronous=True)
    assert isinstance(pending, PendingSave)
    # Training goes on right away: changing the model must not change what is being written.
    with torch.no_grad():
        for p in stage.parameters():
            p.add_(1.0)
    path = pending.wait()
    for kind in ("model", "optimizer"):
        a, b = load_file(sync / kind / "pp0-tp0.safetensors"), load_file(path / kind / "pp0-tp0.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert latest_step(tmp_path / "b") == 4
    assert not (path / "done").exists(), "bookkeeping markers are removed before publishing"


def test_interrupted_save_leaves_previous_checkpoint(tmp_path):
    cfg, stage = tiny()
    save_checkpoint(tmp_path, 2, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    # A job killed while writing step 4 leaves only the .tmp folder behind.
    (tmp_path / "step_4.tmp" / "model").mkdir(parents=True)
    assert resolve(tmp_path).name == "step_2"
    assert CheckpointReader(tmp_path).step == 2
    # The next save cleans the leftover.
    save_checkpoint(tmp_path, 6, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    assert not (tmp_path / "step_4.tmp").exists()
    assert latest_step(tmp_path) == 6


def test_reader_round_trips_weights(tmp_path):
    cfg, stage = tiny()
    save_checkpoint(tmp_path, 1, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    other = LlamaStage(cfg.model.model_config)
    CheckpointReader(tmp_path).load_model(other)
    for (n, a), (_, b) in zip(stage.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(a, b), n
