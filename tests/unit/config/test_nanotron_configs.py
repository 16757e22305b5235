"""Nanotron users bring their configs unchanged.

The configs in tests/data/nanotron/ are written for this project the way Nanotron's examples are
(every section, Nanotron's keys and defaults): a tiny LLaMA that profiles and writes a benchmark
row, a SmolLM2-shaped Qwen2Config resuming with a fresh schedule, and a Qwen2Config holding every
Qwen2 field at its dense-LLaMA value. Each loads and dry-runs. A Nanotron value this engine cannot
honour -- another model (Mamba, LlaMoE, MoE, muP, DoReMi), a field that would change the math, a
key of Nanotron's older schema -- is refused in one line that names the field and what runs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanotron_recover.cli import main
from nanotron_recover.config import (
    Config,
    ConfigError,
    LlamaConfig,
    config_from_dict,
    dump_config,
    load_config,
)
from nanotron_recover.config.loader import load_yaml
from nanotron_recover.config.schema import Qwen2Config
from nanotron_recover.config.validate import config_notes
from nanotron_recover.logging.benchmark import append_row, benchmark_row, throughput
from nanotron_recover.models.llama import LlamaStage
from tests.helpers.mpirun_utils import REPO, check, run_cli
from tests.helpers.nanotron_example import NANOTRON_CONFIGS, NANOTRON_DIR

TINY_LLAMA = NANOTRON_DIR / "tiny_llama.yaml"
SMOLLM2 = NANOTRON_DIR / "smollm2_resume_training.yaml"
QWEN2 = NANOTRON_DIR / "qwen2_dense.yaml"


def load(path: Path, *overrides: str) -> Config:
    # Dry-run semantics: folders and checkpoints named need not exist yet.
    return load_config(path, list(overrides), check_paths=False)


def refusal(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, check_paths=False)
    return str(info.value)


# -- they load and dry-run --------------------------------------------------------------------------
def test_the_configs_are_the_four_kinds():
    assert sorted(p.name for p in NANOTRON_CONFIGS) == [
        "nanoset.yaml",
        "qwen2_dense.yaml",
        "smollm2_resume_training.yaml",
        "tiny_llama.yaml",
    ]


@pytest.mark.parametrize("path", NANOTRON_CONFIGS, ids=lambda p: p.stem)
def test_each_config_dry_runs(path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["train", "--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "world size" in out and "memory per rank" in out
    assert out.count("note: ") == out.count("\nnote: ") + out.startswith("note: ")  # one line each


@pytest.mark.parametrize("path", NANOTRON_CONFIGS, ids=lambda p: p.stem)
def test_each_config_round_trips_through_dump_config(path: Path, tmp_path: Path):
    cfg = load(path)
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(dump_config(cfg))
    again = load(dumped)
    assert again == cfg and type(again.model.model_config) is type(cfg.model.model_config)


def test_the_dry_run_command_prints_the_notes_of_the_tiny_llama():
    """The installed entry point, once, as a user runs it."""
    exe = Path(sys.executable).with_name("nanotron-recover")
    result = subprocess.run(
        [str(exe), "train", "--config", str(TINY_LLAMA), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: parallelism.tp_mode REDUCE_SCATTER runs as ALL_REDUCE here: same math, no "
        "sequence-parallel activation saving",
        "note: parallelism.tp_linear_async_communication true runs synchronously here: same math, "
        "tensor-parallel communication does not overlap compute",
        "note: checkpoints.checkpoints_path_is_shared_file_system false changes nothing (Nanotron main "
        "ignores it too): every rank writes into one checkpoint folder, so a job across nodes needs "
        "checkpoints_path on a file system they all see",
    ]
    assert "profiler        steps 5 " in result.stdout
    assert "benchmark csv   benchmarks_out/tiny_llama.csv" in result.stdout


def test_tiny_llama_keeps_what_it_asks_for():
    cfg = load(TINY_LLAMA)
    assert cfg.parallelism.tp_mode == "REDUCE_SCATTER" and cfg.parallelism.tp_linear_async_communication
    assert cfg.general.benchmark_csv_path == Path("benchmarks_out/tiny_llama.csv")
    assert cfg.profiler is not None and cfg.profiler.profiler_export_path == Path("traces/tiny_llama")
    prof = cfg.profiler
    assert (prof.skip_first, prof.wait, prof.warmup, prof.active, prof.repeat) == (3, 1, 1, 1, 1)
    assert cfg.lighteval is None and cfg.s3_upload is None


def test_the_smollm2_qwen2_config_is_a_llama():
    cfg = load(SMOLLM2)
    m = cfg.model.model_config
    assert type(m) is Qwen2Config and isinstance(m, LlamaConfig)
    assert m.is_llama_config and m.is_qwen2_config
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.kv_heads) == (576, 30, 9, 3)
    assert m.rope_theta == 100000.0 and m.interleaved_rotary is False and m._attn_implementation == "sdpa"
    p, ck = cfg.parallelism, cfg.checkpoints
    assert (p.context_parallel_size, p.moe_layer_recompute, p.tp_recompute_allgather) == (1, False, True)
    assert (ck.load_lr_scheduler, ck.load_optimizer, ck.save_final_state) == (False, False, True)
    assert cfg.general.ignore_sanity_checks is False and cfg.s3_upload is None
    assert [note.split(" ")[1] for note in config_notes(cfg)] == [
        "general.ignore_sanity_checks",
        "checkpoints.checkpoints_path_is_shared_file_system",
        "checkpoints.load_lr_scheduler",
    ]


def test_every_field_of_nanotrons_qwen2_config_is_known():
    # The fields of Nanotron main's Qwen2Config (src/nanotron/config/models_config.py), by name.
    nanotron_fields = """bos_token_id eos_token_id hidden_act hidden_size initializer_range intermediate_size
        is_qwen2_config max_position_embeddings num_attention_heads num_hidden_layers num_key_value_heads
        pad_token_id pretraining_tp rms_norm_eps rope_scaling rope_theta rope_interleaved
        rope_seq_len_interpolation_factor tie_word_embeddings use_cache vocab_size _attn_implementation
        flex_attention_mask attention_bias sliding_window_size z_loss_enabled z_loss_coefficient
        no_rope_layer _fused_rotary_emb _fused_rms_norm _use_qkv_packed _use_doc_masking log_attn_probs
        ring_attn_heads_k_stride moe_config""".split()
    ours = {f.name for f in dataclasses.fields(Qwen2Config) if f.init}
    assert set(nanotron_fields) <= ours
    assert set(load_yaml(QWEN2)["model"]["model_config"]) == set(nanotron_fields)
    assert load(QWEN2).model.model_config == Qwen2Config(
        **{**load_yaml(QWEN2)["model"]["model_config"], "rope_theta": 10000.0}
    )


def test_a_dense_qwen2_builds_the_same_model_as_its_llama():
    qwen = load(QWEN2, "model.model_config.num_hidden_layers=2", "model.model_config.hidden_size=64")
    m = qwen.model.model_config
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(LlamaConfig)}
    llama = LlamaConfig(**{**fields, "_attn_implementation": None})
    a, b = LlamaStage(m), LlamaStage(llama)
    a.init_weights(0.02, seed=5)
    b.init_weights(0.02, seed=5)
    tokens = torch.randint(0, m.vocab_size, (2, 16))
    assert torch.equal(a(tokens), b(tokens))
    # What a checkpoint records of it is plain JSON.
    assert json.loads(json.dumps(dataclasses.asdict(m)))["is_qwen2_config"] is True


def test_a_qwen2_config_trains_and_checkpoints_as_a_llama(tmp_path: Path):
    """One rank, two steps of the tiny CPU model written as a Nanotron Qwen2Config."""
    run_dir = tmp_path / "run"
    sets = [
        "parallelism.dp=1",
        "tokens.batch_accumulation_per_replica=1",
        "tokens.train_steps=2",
        "model.model_config.is_qwen2_config=true",
        "model.model_config._use_qkv_packed=true",
        "model.model_config._attn_implementation=flash_attention_2",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
    ]
    cmd = ["train", "--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    result = check(run_cli(cmd, timeout=180))
    assert "note: model.model_config._attn_implementation flash_attention_2 runs as torch" in result.stdout
    meta = json.loads((run_dir / "checkpoints" / "step_2" / "meta.json").read_text())
    assert meta["model_config"]["is_qwen2_config"] is True and meta["lr_schedule_origin"] == 0


# -- one-line refusals ---------------------------------------------------------------------------
def with_change(path: Path, change) -> dict:
    data = copy.deepcopy(load_yaml(path))
    change(data)
    return data


def model_config(**values):
    return lambda d: d["model"]["model_config"].update(values)


def replace_model_config(values: dict):
    return lambda d: d["model"].update(model_config=values)


MAMBA = {"d_model": 256, "is_mamba_config": True, "num_hidden_layers": 4, "ssm_cfg": {"d_state": 16}}
LLAMOE = {"hidden_size": 256, "is_llamoe_config": True, "moe_num_experts": 4, "num_experts_per_tok": 1}


@pytest.mark.parametrize(
    ("path", "change", "expected"),
    [
        (
            QWEN2,
            model_config(moe_config={"num_experts": 8, "top_k": 2}),
            "model.model_config.moe_config={num_experts: 8, top_k: 2} is not supported: mixture-of-experts "
            "layers are not implemented (this engine trains dense LLaMA models); set null",
        ),
        (
            TINY_LLAMA,
            lambda d: d["parallelism"].update(context_parallel_size=2),
            "parallelism.context_parallel_size=2 is not supported: context parallelism is not implemented "
            "(every rank of a replica holds whole sequences); set 1",
        ),
        (
            TINY_LLAMA,
            replace_model_config(MAMBA),
            "model.model_config.is_mamba_config=true is not supported: Mamba (a state-space model) is not "
            "a dense LLaMA, the only model this engine trains; set is_llama_config: true (or Nanotron's "
            "Qwen2Config, is_qwen2_config: true, describing a dense LLaMA)",
        ),
        (
            TINY_LLAMA,
            replace_model_config(LLAMOE),
            "model.model_config.is_llamoe_config=true is not supported: LlaMoE (a mixture-of-experts LLaMA)",
        ),
        (
            TINY_LLAMA,
            replace_model_config({"is_starcoder2_config": True, "n_layer": 2}),
            "model.model_config.is_starcoder2_config=true is not supported: Starcoder2 is not a dense LLaMA",
        ),
        (
            TINY_LLAMA,
            lambda d: d["model"].update(init_method={"use_mup": True}),
            "model.init_method.use_mup is not supported: spectral muP (Nanotron's SpectralMupInit) is not "
            "implemented, LLaMA trains in standard parametrisation here; set model.init_method to "
            "{std: ...} or {path: ...}",
        ),
        (
            TINY_LLAMA,
            lambda d: d["optimizer"].update(adam_beta1=0.9, adam_beta2=0.95),
            "optimizer.adam_beta1 is Nanotron's older schema (Nanotron main refuses it too): it goes under "
            "optimizer.optimizer_factory.adam_beta1 now, next to name: adamW",
        ),
        (
            TINY_LLAMA,
            lambda d: d["optimizer"].update(torch_adam_is_fused=True),
            "optimizer.torch_adam_is_fused is Nanotron's older schema",
        ),
        (
            TINY_LLAMA,
            lambda d: d.update(data={"dataset": None, "seed": 1}),
            "data is Nanotron's older schema (Nanotron main refuses it too): the section goes under "
            "data_stages now, as data_stages: [{name: ..., start_training_step: 1, data: <this section>}]",
        ),
        (
            TINY_LLAMA,
            lambda d: d.update(doremi={"domain_names": "a, b"}, data={"seed": 1}),
            "doremi is not supported: DoReMi (Nanotron's domain reweighting with a reference and a proxy "
            "model) is not implemented, this engine pre-trains one dense LLaMA; remove the section",
        ),
        (
            SMOLLM2,
            lambda d: d.update(s3_upload={"upload_s3_path": "s3://bucket/run", "remove_after_upload": True}),
            "s3_upload={upload_s3_path: 's3://bucket/run', remove_after_upload: true} is not supported: "
            "checkpoints are not uploaded to S3 (copy checkpoints.checkpoints_path with your own tool); "
            "set null",
        ),
        (
            TINY_LLAMA,
            lambda d: d.update(lighteval={"batch_size": 16}),
            "lighteval={batch_size: 16} is not supported: no LightEval evaluation runs during training "
            "(score a checkpoint with `nanotron-recover eval`); set null",
        ),
        (
            QWEN2,
            lambda d: d["metrics_logging"].update(log_level=1),
            "metrics_logging.log_level=1 is not supported: detailed per-layer metrics are not logged",
        ),
        (
            QWEN2,
            model_config(_use_doc_masking=True),
            "model.model_config._use_doc_masking=true is not supported: documents packed into a sample "
            "are not masked from each other",
        ),
        (
            QWEN2,
            model_config(sliding_window_size=20),
            "model.model_config.sliding_window_size=20 is not supported: attention is full causal "
            "attention (no sliding window); set null",
        ),
        (
            QWEN2,
            model_config(flex_attention_mask="document"),
            "model.model_config.flex_attention_mask=document is not supported: ",
        ),
        (QWEN2, model_config(no_rope_layer=4), "model.model_config.no_rope_layer=4 is not supported: "),
        (
            QWEN2,
            model_config(rope_seq_len_interpolation_factor=2.0),
            "model.model_config.rope_seq_len_interpolation_factor=2.0 is not supported: RoPE position "
            "interpolation is not implemented; set null",
        ),
        (
            QWEN2,
            model_config(attention_bias=True),
            "model.model_config.attention_bias=true is not supported: the attention projections have no "
            "bias in LLaMA; set false",
        ),
        (
            TINY_LLAMA,
            model_config(attention_bias=True),
            "model.model_config.attention_bias=true is not supported",
        ),
        (
            TINY_LLAMA,
            model_config(z_loss_enabled=True),
            "model.model_config.z_loss_enabled=true is not supported: the loss is the plain cross-entropy "
            "(no z-loss term); set false",
        ),
        (
            QWEN2,
            lambda d: d["model"]["init_method"].update(scaling_method="LAYER_INDEX"),
            "model.init_method.scaling_method=LAYER_INDEX is not supported: Nanotron implements only "
            "these two (LAYER_INDEX raises there too); set NUM_LAYERS or NONE",
        ),
        (
            SMOLLM2,
            model_config(interleaved_rotary=True),
            "model.model_config.interleaved_rotary=true disagrees with rope_interleaved=false: "
            "interleaved_rotary is an older spelling of rope_interleaved; remove it or set both the same",
        ),
        (
            QWEN2,
            model_config(is_qwen2_config=False),
            "model.model_config.is_qwen2_config=false is not supported: ",
        ),
        (
            QWEN2,
            model_config(is_llama_config=True),
            "unknown key 'is_llama_config' in section 'model.model_config'",
        ),
        (
            TINY_LLAMA,
            lambda d: d["parallelism"].update(expert_parallel_size=2),
            "parallelism.expert_parallel_size=2 is not supported: LLaMA has no experts; set 1",
        ),
        (
            QWEN2,
            lambda d: d["optimizer"].update(weight_decay_exclude_named_params=["bias$"]),
            "optimizer.weight_decay_exclude_named_params=[bias$] is not supported: every parameter is "
            "decayed by optimizer.weight_decay; set null or []",
        ),
        (
            QWEN2,
            model_config(_attn_implementation="paged"),
            "model.model_config._attn_implementation: must be one of 'flash_attention_2', 'flex_attention', "
            "'sdpa', 'eager', 'ring_flash_triton', 'ring', 'llama3_ring_attention', got 'paged'",
        ),
    ],
    ids=lambda v: None if not isinstance(v, str) or len(v) > 30 else v,
)
def test_a_value_that_cannot_be_honoured_is_refused_in_one_line(path: Path, change, expected: str):
    message = refusal(with_change(path, change))
    assert "\n" not in message
    assert message.startswith(expected), message


def test_the_model_is_refused_before_anything_else():
    # A Mamba config's other sections (its own init keys, a layout Mamba would run) are moot.
    def mamba(d: dict) -> None:
        d["model"]["model_config"] = MAMBA
        d["model"]["init_method"] = {"initializer_range": 0.02, "n_residuals_per_layer": 1}
        d["parallelism"]["tp"] = 3

    assert refusal(with_change(TINY_LLAMA, mamba)).startswith("model.model_config.is_mamba_config=true")


# -- the benchmark row ------------------------------------------------------------------------------
def test_throughput_leaves_the_first_step_out():
    assert throughput([5.0, 1.0, 3.0], tokens_per_step=100) == (2, 50.0, 2.0)
    assert throughput([2.0], tokens_per_step=100) == (1, 50.0, 2.0)
    assert throughput([], tokens_per_step=100) == (0, 0.0, 0.0)


def test_benchmark_rows_share_one_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    cfg = load(TINY_LLAMA)
    row = benchmark_row(cfg, [9.0, 0.5, 0.5], "tiny_llama_%date_%jobid", world_size=4)
    assert row["job_id"] == "4242"
    assert row["name"].startswith("tiny_llama_2") and row["name"].endswith("_4242")  # %date, %jobid
    layout = {"dp": 2, "tp": 2, "pp": 1, "mbs": 4, "batch_accum": 4, "gbs": 32}
    assert {key: row[key] for key in layout} == layout
    assert row["seq_len"] == 1024 and row["tp_mode"] == "REDUCE_SCATTER"
    assert float(row["tokens_per_s"]) == cfg.tokens_per_step / 0.5
    assert float(row["tok/s/gpu"]) == cfg.tokens_per_step / 0.5 / 4
    assert row["Total Params"] == 41_558_528

    csv_path = tmp_path / "sweep" / "bench.csv"
    append_row(csv_path, row)
    append_row(csv_path, {**row, "name": "second"})
    lines = csv_path.read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("job_id,name,nodes,world_size,seq_len,mbs")
    assert lines[2].split(",")[1] == "second"


def test_the_nanoset_config_reads_one_folder_then_a_list_then_a_blend():
    stages = load(NANOTRON_DIR / "nanoset.yaml").data_stages
    assert [s.start_training_step for s in stages] == [1, 15, 25]
    one, listed, blend = (s.data.dataset for s in stages)
    assert one.folders() == ["datasets/c4-es/tokenized"] and one.weights() is None
    assert listed.folders() == ["datasets/SlimPajama-6B/tokenized", "datasets/c4-es/tokenized"]
    assert listed.weights() is None  # weighted by size, read from the folders when training
    assert blend.folders() == listed.folders() and blend.weights() == [0.8, 0.2]
