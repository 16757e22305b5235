"""``convert`` to and from Hugging Face ``LlamaForCausalLM`` folders.

HF -> ours -> HF must give back the very same tensors (tied and untied); a checkpoint saved by a
tp=2 training run must convert to an HF model whose logits are ``eval``'s on tp=1 (resharding); and
a folder that does not match the YAML config must be refused with one line naming what differs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers import hf_models
from tests.helpers.hf_models import MODEL, VOCAB, save_random_hf_model
from tests.helpers.mpirun_utils import Completed, check, run_cli

# Megatron layout, from the HF weight shapes [out, in]: column-parallel weights and the embedding are
# split on dim 0, row-parallel (o_proj, down_proj) on dim 1, norms are replicated.
SPLIT_DIM = {
    "embed_tokens": 0,
    "lm_head": 0,
    "q_proj": 0,
    "k_proj": 0,
    "v_proj": 0,
    "gate_proj": 0,
    "up_proj": 0,
    "o_proj": 1,
    "down_proj": 1,
    "input_layernorm": None,
    "post_attention_layernorm": None,
    "norm": None,
}


def load_hf(folder: Path) -> tuple[LlamaForCausalLM, dict]:
    model, info = LlamaForCausalLM.from_pretrained(
        folder, local_files_only=True, attn_implementation="eager", output_loading_info=True
    )
    return model.eval(), info


def logits_of(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def rope_theta(config: LlamaConfig) -> float:
    """transformers >= 5 keeps rope_theta in rope_parameters; older versions on the config."""
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", None))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def convert(config: Path, *args: str) -> Completed:
    return run_cli(["convert", "--config", str(config), *args], timeout=120)


def assert_one_line_error(result: Completed, *words: str) -> str:
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# -- round trip ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_to_ours_to_hf_is_bitwise_identical(tmp_path: Path, tie: bool):
    config = hf_models.write_config(tmp_path / "config.yaml", tie)
    hf_dir = save_random_hf_model(tmp_path / "hf", tie, seed=11)
    checkpoint, back = tmp_path / "checkpoint", tmp_path / "back"

    check(convert(config, "--from-hf", str(hf_dir), "--out", str(checkpoint)))
    check(convert(config, "--to-hf", str(checkpoint), "--out", str(back)))

    meta = json.loads((checkpoint / "step_0" / "meta.json").read_text())
    assert meta["layout"] == {"tp": 1, "pp": 1, "dp": 1}
    assert meta["has_optimizer"] is False

    original = load_file(hf_dir / "model.safetensors")
    written = load_file(back / "model.safetensors")
    assert sorted(written) == sorted(original)
    assert len(written) == 3 + 9 * MODEL["num_hidden_layers"] - tie  # embed, norm, head + 9 per layer
    assert ("lm_head.weight" in written) is not tie
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype == torch.float32, name
        assert written[name].shape == tensor.shape, name
        assert torch.equal(bits(written[name]), bits(tensor)), name

    model, info = load_hf(back)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (32, 64, VOCAB)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (4, 2, 2)
    assert cfg.tie_word_embeddings is tie
    assert rope_theta(cfg) == MODEL["rope_theta"]
    assert cfg.rms_norm_eps == MODEL["rms_norm_eps"]
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    ids = torch.from_numpy(np.random.default_rng(3).integers(0, VOCAB, size=(2, 12)))
    reference, _ = load_hf(hf_dir)
    assert torch.equal(logits_of(model, ids), logits_of(reference, ids))


def test_transformers4_style_config_with_top_level_rope_theta_converts(tmp_path: Path):
    config = hf_models.write_config(tmp_path / "config.yaml", tie=False)
    hf_dir = save_random_hf_model(tmp_path / "hf", tie=False, seed=5)
    hf_json = json.loads((hf_dir / "config.json").read_text())
    hf_json.pop("rope_parameters", None)
    hf_json.update(rope_theta=10000.0, rope_scaling=None)
    (hf_dir / "config.json").write_text(json.dumps(hf_json))

    check(convert(config, "--from-hf", str(hf_dir), "--out", str(tmp_path / "checkpoint")))

    assert (tmp_path / "checkpoint" / "latest").read_text().strip() == "step_0"


# -- resharding: a tp=2 training checkpoint --------------------------------------------------------
@pytest.mark.mpi
def test_tp2_training_checkpoint_to_hf_matches_eval_on_tp1(tmp_path: Path):
    config = hf_models.write_config(tmp_path / "config.yaml", tie=False)
    root = tmp_path / "checkpoints"
    overrides = [
        "parallelism.tp=2",
        "parallelism.dp=1",
        "tokens.train_steps=1",
        f"checkpoints.checkpoints_path={root}",
    ]
    train = ["train", "--config", str(config), "--run-dir", str(tmp_path / "run")]
    check(run_cli(train + [f"--set={o}" for o in overrides], nproc=2, timeout=240))
    step = root / "step_1"
    assert json.loads((step / "meta.json").read_text())["layout"] == {"tp": 2, "pp": 1, "dp": 1}

    hf_dir = tmp_path / "hf"
    check(convert(config, "--to-hf", str(root), "--out", str(hf_dir)))

    # Every HF tensor is the two saved shards put back together on the Megatron split dimension.
    shards = [load_file(step / "model" / f"pp0-tp{t}.safetensors") for t in range(2)]
    full = load_file(hf_dir / "model.safetensors")
    assert sorted(full) == sorted(shards[0]) == sorted(shards[1])
    for name, tensor in full.items():
        dim = SPLIT_DIM[name.split(".")[-2]]
        if dim is None:
            assert torch.equal(shards[0][name], shards[1][name]), name
            expected = shards[0][name]
        else:
            assert shards[0][name].shape[dim] * 2 == tensor.shape[dim], name
            expected = torch.cat([shards[0][name], shards[1][name]], dim=dim)
        assert torch.equal(tensor, expected), name
    assert full["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    assert full["model.layers.1.mlp.down_proj.weight"].shape == (32, 64)

    model, info = load_hf(hf_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"], info

    tokens = np.random.default_rng(9).integers(0, VOCAB, size=(2, 12), dtype=np.int64)
    tokens_file, logits_file = tmp_path / "tokens.npy", tmp_path / "logits.npy"
    np.save(tokens_file, tokens)
    evaluate = ["eval", "--config", str(config), "--checkpoint", str(root), "--tokens", str(tokens_file)]
    check(run_cli(evaluate + ["--logits-out", str(logits_file)], timeout=120))
    ours = np.load(logits_file)
    theirs = logits_of(model, torch.from_numpy(tokens)[:, :-1]).numpy()
    assert ours.shape == theirs.shape == (2, 11, VOCAB)
    assert np.abs(ours - theirs).max() < 1e-4
    assert theirs.std() > 0.1  # trained weights, not an all-zero head


@pytest.mark.mpi
def test_hsdp_training_checkpoint_to_hf_matches_hf(tmp_path: Path):
    """A checkpoint written by the HSDP engine (FSDP2 over 2 ranks) converts to a Hugging Face model
    whose logits are our eval's on tp=1."""
    config = hf_models.write_config(tmp_path / "config.yaml", tie=False)
    root = tmp_path / "checkpoints"
    overrides = ["parallelism.dp_shard=2", "parallelism.dp=1", "tokens.train_steps=1"]
    overrides.append(f"checkpoints.checkpoints_path={root}")
    train = ["train", "--config", str(config), "--run-dir", str(tmp_path / "run")]
    check(run_cli(train + [f"--set={o}" for o in overrides], nproc=2, timeout=240))
    assert json.loads((root / "step_1" / "meta.json").read_text())["layout"] == {"tp": 1, "pp": 1, "dp": 1}
    hf_dir = tmp_path / "hf"
    check(convert(config, "--to-hf", str(root), "--out", str(hf_dir)))
    model, info = load_hf(hf_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = np.random.default_rng(3).integers(0, VOCAB, size=(2, 12), dtype=np.int64)
    tokens_file, logits_file = tmp_path / "tokens.npy", tmp_path / "logits.npy"
    np.save(tokens_file, tokens)
    evaluate = ["eval", "--config", str(config), "--checkpoint", str(root), "--tokens", str(tokens_file)]
    check(run_cli(evaluate + ["--logits-out", str(logits_file)], timeout=120))
    theirs = logits_of(model, torch.from_numpy(tokens)[:, :-1]).numpy()
    assert np.abs(np.load(logits_file) - theirs).max() < 1e-4
    assert theirs.std() > 0.1


# -- errors --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One saved untied HF model; tests copy it and edit the copy."""
    return save_random_hf_model(tmp_path_factory.mktemp("hf_template") / "hf", tie=False, seed=21)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", 64),
        ("vocab_size", 256),
        ("num_hidden_layers", 3),
        ("num_key_value_heads", 4),
        ("tie_word_embeddings", True),
        ("rope_theta", 500000.0),
    ],
)
def test_from_hf_config_mismatch_exits_2_naming_the_field(hf_template: Path, tmp_path: Path, field, value):
    config = hf_models.write_config(tmp_path / "config.yaml", tie=False)
    hf_dir = shutil.copytree(hf_template, tmp_path / "hf")
    hf_json = json.loads((hf_dir / "config.json").read_text())
    if field == "rope_theta" and "rope_parameters" in hf_json:
        hf_json["rope_parameters"]["rope_theta"] = value
    else:
        hf_json[field] = value
    (hf_dir / "config.json").write_text(json.dumps(hf_json))
    out = tmp_path / "checkpoint"

    result = convert(config, "--from-hf", str(hf_dir), "--out", str(out))

    assert_one_line_error(result, field, str(hf_dir))
    assert not out.exists()


def test_from_hf_rope_scaling_is_refused(hf_template: Path, tmp_path: Path):
    config = hf_models.write_config(tmp_path / "config.yaml", tie=False)
    hf_dir = shutil.copytree(hf_template, tmp_path / "hf")
    hf_json = json.loads((hf_dir / "config.json").read_text())
    hf_json["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (hf_dir / "config.json").write_text(json.dumps(hf_json))

    result = convert(config, "--from-hf", str(hf_dir), "--out", str(tmp_path / "checkpoint"))

    assert_one_line_error(result, "rope_scaling")


def test_from_hf_without_config_json_exits_2(hf_template: Path, tmp_path: Path):
    config = hf_models.write_config(tmp_path / "config.yaml", tie=False)
    hf_dir = shutil.copytree(hf_template, tmp_path / "hf")
    (hf_dir / "config.json").unlink()
    out = tmp_path / "checkpoint"

    result = convert(config, "--from-hf", str(hf_dir), "--out", str(out))

    assert_one_line_error(result, "no config.json", str(hf_dir))
    assert not out.exists()


def _not_json(hf_dir: Path) -> None:
    (hf_dir / "config.json").write_text('{"model_type": "llama",\n')


def _truncated_weights(hf_dir: Path) -> None:
    weights = hf_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (_not_json, ["config.json", "not a readable JSON file"]),
        (_truncated_weights, ["model.safetensors", "unreadable safetensors file"]),
    ],
    ids=["config-not-json", "truncated-weights"],
)
def test_from_hf_damaged_folder_exits_2_naming_the_file(hf_template: Path, tmp_path: Path, damage, words):
    config = hf_models.write_config(tmp_path / "config.yaml", tie=False)
    hf_dir = shutil.copytree(hf_template, tmp_path / "hf")
    damage(hf_dir)
    out = tmp_path / "checkpoint"

    result = convert(config, "--from-hf", str(hf_dir), "--out", str(out))

    assert_one_line_error(result, *words, str(hf_dir))
    assert not out.exists()


def test_from_hf_out_that_is_a_file_exits_2(hf_template: Path, tmp_path: Path):
    config = hf_models.write_config(tmp_path / "config.yaml", tie=False)
    out = tmp_path / "checkpoint"
    out.write_text("not a folder")

    result = convert(config, "--from-hf", str(hf_template), "--out", str(out))

    assert_one_line_error(result, str(out), "is a file")


def test_to_hf_missing_checkpoint_exits_2(tmp_path: Path):
    config = hf_models.write_config(tmp_path / "config.yaml", tie=False)
    missing = tmp_path / "no_such_checkpoint"

    result = convert(config, "--to-hf", str(missing), "--out", str(tmp_path / "hf"))

    assert_one_line_error(result, "no checkpoint", str(missing))
    assert not (tmp_path / "hf" / "model.safetensors").exists()
