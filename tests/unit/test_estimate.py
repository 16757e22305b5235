"""nanotron_recover.estimate and count_parameters: parameter counts and per-rank memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nanotron_recover.config import Config, ConfigError, LlamaConfig, load_config
from nanotron_recover.estimate import estimate_stage, format_plan, plan_summary
from nanotron_recover.models.llama import LlamaStage, count_parameters
from tests.helpers.nanotron_example import NANOTRON, NANOTRON_CONFIGS

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"
LLAMA_7B = [
    "model.model_config.hidden_size=4096",
    "model.model_config.intermediate_size=11008",
    "model.model_config.num_attention_heads=32",
    "model.model_config.num_key_value_heads=null",
    "model.model_config.num_hidden_layers=32",
    "model.model_config.vocab_size=32000",
    "model.model_config.tie_word_embeddings=false",
    "model.model_config.max_position_embeddings=4096",
    "tokens.sequence_length=4096",
    "tokens.micro_batch_size=1",
]


def config(*overrides: str, base: Path = TINY) -> Config:
    return load_config(base, list(overrides), check_paths=False)


def llama_7b(*overrides: str) -> Config:
    return config(*LLAMA_7B, *overrides)


def numel(module: torch.nn.Module) -> int:
    """Parameters of a module, a tied weight once (``parameters()`` deduplicates)."""
    return sum(p.numel() for p in module.parameters())


def by_hand(h: int, i: int, v: int, layers: int, heads: int, kv_heads: int, tied: bool) -> int:
    """LLaMA parameters written out: q and o are h x h, k and v are h x (kv_heads * head_dim), three
    h x i MLP matrices and two RMSNorm vectors per layer; embedding, final norm and output head."""
    d = h // heads
    per_layer = 2 * h * h + 2 * h * kv_heads * d + 3 * h * i + 2 * h
    return v * h + layers * per_layer + h + (0 if tied else v * h)


# -- count_parameters ------------------------------------------------------------------------------
def test_tiny_config_count_matches_the_built_model():
    cfg = config()
    model = LlamaStage(cfg.model.model_config)
    assert count_parameters(cfg.model.model_config) == numel(model) == 139_584
    assert plan_summary(cfg)["parameters"] == 139_584


def test_tied_nanotron_example_count_matches_the_built_model():
    m = config(base=NANOTRON).model.model_config
    model = LlamaStage(m)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert count_parameters(m) == numel(model) == by_hand(16, 64, 256, 2, 4, 4, tied=True) == 12_368


def test_llama_7b_count():
    m = llama_7b().model.model_config
    expected = by_hand(4096, 11008, 32000, 32, 32, 32, tied=False)
    assert expected == 6_738_415_616
    assert count_parameters(m) == expected
    assert numel(LlamaStage(m, device="meta")) == expected


def test_grouped_query_attention_count_matches_a_meta_model():
    m = llama_7b("model.model_config.num_key_value_heads=8", "model.model_config.tie_word_embeddings=true")
    m = m.model.model_config
    expected = by_hand(4096, 11008, 32000, 32, 32, 8, tied=True)
    assert count_parameters(m) == numel(LlamaStage(m, device="meta")) == expected
    assert expected == 6_738_415_616 - 32 * 2 * 4096 * 3072 - 32000 * 4096


# -- per-stage parameters ----------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 3, 5])
def test_stage_parameters_match_the_built_stages(pp: int, tied: bool):
    cfg = config(
        "model.model_config.num_hidden_layers=5",
        f"model.model_config.tie_word_embeddings={str(tied).lower()}",
        f"parallelism.pp={pp}",
    )
    built = [numel(LlamaStage(cfg.model.model_config, pp=pp, pp_rank=r, device="meta")) for r in range(pp)]
    estimated = [estimate_stage(cfg, r).parameters for r in range(pp)]
    assert estimated == built
    # Across stages: the whole model, plus the tied head's copy on the last stage when pp > 1.
    v, h = 512, 64
    assert sum(estimated) == count_parameters(cfg.model.model_config) + (v * h if tied and pp > 1 else 0)


@pytest.mark.parametrize("tp", [2, 4])
def test_stage_parameters_per_tensor_parallel_rank(tp: int):
    cfg = config("parallelism.tp=1", "parallelism.pp=2", "model.model_config.num_key_value_heads=4")
    sharded_cfg = config(
        f"parallelism.tp={tp}", "parallelism.pp=2", "model.model_config.num_key_value_heads=4"
    )
    for r in range(2):
        stage = LlamaStage(cfg.model.model_config, pp=2, pp_rank=r, device="meta")
        params = dict(stage.named_parameters())
        per_rank = sum(
            params[name].numel() // (tp if spec.shard_dim is not None else 1)
            for name, spec in stage.specs.items()
        )
        assert estimate_stage(sharded_cfg, r).parameters == per_rank


# -- memory ------------------------------------------------------------------------------------
def test_more_tensor_parallelism_means_fewer_bytes_per_rank():
    stages = {
        tp: estimate_stage(llama_7b(f"parallelism.tp={tp}", "model.dtype=bfloat16"), 0) for tp in (1, 2, 4, 8)
    }
    for small, big in [(1, 2), (2, 4), (4, 8)]:
        a, b = stages[small], stages[big]
        assert b.total_bytes < a.total_bytes
        assert b.parameters < a.parameters
        for field in ("param_bytes", "master_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"):
            assert getattr(b, field) < getattr(a, field), field
    # Only the two RMSNorm vectors per layer (and the final norm) are replicated: almost exactly 1/8.
    assert stages[8].parameters == pytest.approx(stages[1].parameters / 8, rel=1e-3)


def test_more_pipeline_parallelism_means_fewer_bytes_on_the_heaviest_stage():
    totals = {
        pp: plan_summary(llama_7b(f"parallelism.pp={pp}"))["worst_stage"].total_bytes for pp in (1, 2, 4, 8)
    }
    assert totals[1] > totals[2] > totals[4] > totals[8]
    layers = {pp: estimate_stage(llama_7b(f"parallelism.pp={pp}"), 0).layers for pp in (1, 2, 4, 8)}
    assert layers == {1: 32, 2: 16, 4: 8, 8: 4}


def test_fp32_model_has_no_master_copy():
    e = estimate_stage(llama_7b("model.dtype=float32"), 0)
    assert e.parameters == 6_738_415_616
    assert e.master_bytes == 0
    assert e.param_bytes == 4 * e.parameters
    assert e.grad_bytes == 4 * e.parameters
    assert e.optimizer_bytes == 8 * e.parameters


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_model_has_an_fp32_master_copy(dtype: str):
    e = estimate_stage(llama_7b(f"model.dtype={dtype}"), 0)
    assert e.param_bytes == 2 * e.parameters
    assert e.master_bytes == 4 * e.parameters
    assert e.grad_bytes == 4 * e.parameters
    assert e.optimizer_bytes == 8 * e.parameters
    assert e.total_bytes == 18 * e.parameters + e.activation_bytes


def test_fp32_activations_are_twice_bf16_activations_before_the_logits():
    bf16 = estimate_stage(llama_7b("parallelism.pp=2", "model.dtype=bfloat16"), 0)
    fp32 = estimate_stage(llama_7b("parallelism.pp=2", "model.dtype=float32"), 0)
    assert fp32.activation_bytes == 2 * bf16.activation_bytes > 0


def test_afab_keeps_every_micro_batch_in_flight_and_1f1b_at_most_pp():
    common = ["parallelism.pp=2", "tokens.batch_accumulation_per_replica=8"]
    one_f_one_b = estimate_stage(llama_7b(*common, "parallelism.pp_engine=1f1b"), 0)
    afab = estimate_stage(llama_7b(*common, "parallelism.pp_engine=afab"), 0)
    # Stage 0 of 2: 1F1B holds min(pp - 0, G) = 2 micro-batches, AFAB all G = 8.
    assert afab.activation_bytes == 4 * one_f_one_b.activation_bytes


def test_plan_summary_reports_the_layout():
    s = plan_summary(llama_7b("parallelism.tp=2", "parallelism.pp=4", "parallelism.dp=3"))
    assert (s["world_size"], s["tp"], s["pp"], s["replicas"]) == (24, 2, 4, 3)
    assert s["B"] == 3 * 4 and s["G"] == 4
    assert s["tokens_per_step"] == 12 * 1 * 4096
    assert [e.pp_rank for e in s["stages"]] == [0, 1, 2, 3]
    assert s["worst_stage"].total_bytes == max(e.total_bytes for e in s["stages"])


def test_llama_config_defaults_are_llama_7b():
    assert count_parameters(LlamaConfig()) == 6_738_415_616


def test_hsdp_plan_for_the_7b_cluster_config_fits_an_a100_40gb():
    """The HSDP cluster config (FSDP2 over 8 ranks per replica, 64 replicas) plans 512 ranks and a
    per-rank estimate under 40 GiB, with the recovery snapshot of the gradient shard counted."""
    cfg = load_config(REPO / "configs" / "llama7b_c4_hsdp.yaml", check_paths=False)
    plan = plan_summary(cfg)
    assert plan["engine"] == "hsdp" and plan["world_size"] == 512 and plan["dp_shard"] == 8
    worst = plan["worst_stage"]
    assert worst.snapshot_bytes == worst.grad_bytes > 0
    assert worst.parameters * 8 >= plan["parameters"]  # the heaviest rank holds at least 1/8 of it
    assert worst.total_bytes < 40 * 2**30


def test_hsdp_needs_tp_and_pp_of_one():
    with pytest.raises(ConfigError, match="dp_shard=2 .HSDP. needs tp=1 and pp=1"):
        load_config(TINY, ["parallelism.dp_shard=2", "parallelism.tp=2"])


# -- configs written like Nanotron's examples ------------------------------------------------------
def nanotron_config(name: str) -> Config:
    return config(base=next(p for p in NANOTRON_CONFIGS if p.stem == name))


def test_a_qwen2_config_of_smollm2_counts_as_the_llama_it_is():
    m = nanotron_config("smollm2_resume_training").model.model_config
    # SmolLM2-135M: 30 layers of width 576, 9 query and 3 key/value heads, tied 49152-token vocab.
    expected = by_hand(576, 1536, 49152, 30, 9, 3, tied=True)
    assert count_parameters(m) == numel(LlamaStage(m, device="meta")) == expected == 134_515_008


def test_strategies_run_the_plain_way_are_estimated_the_plain_way():
    # Sequence parallelism, asynchronous TP linears and recomputation are accepted but not run: the
    # estimate is the one of the plain layout (all activations kept, nothing split by sequence).
    base = nanotron_config("tiny_llama")
    plain = config(
        "parallelism.tp_mode=ALL_REDUCE",
        "parallelism.tp_linear_async_communication=false",
        base=next(p for p in NANOTRON_CONFIGS if p.stem == "tiny_llama"),
    )
    recompute = config("parallelism.recompute_layer=true", base=NANOTRON)
    assert plan_summary(base)["worst_stage"] == plan_summary(plain)["worst_stage"]
    assert plan_summary(recompute)["worst_stage"] == plan_summary(config(base=NANOTRON))["worst_stage"]


def test_the_plan_opens_with_the_notes_and_names_the_profiler_window_and_the_benchmark_csv():
    lines = format_plan(plan_summary(nanotron_config("tiny_llama"))).splitlines()
    assert lines[0].startswith("note: parallelism.tp_mode REDUCE_SCATTER runs as ALL_REDUCE here")
    assert lines[1].startswith("note: parallelism.tp_linear_async_communication true runs synchronously")
    assert lines[2].startswith("note: checkpoints.checkpoints_path_is_shared_file_system false")
    assert lines[3].startswith("world size      4  (tp=2 x pp=1 x dp=2)")
    # Nanotron's default window: skip 3, wait 1, warm up 1, record 1.
    assert "profiler        steps 5 (of a run from step 1)" in lines[-2] and "traces/tiny_llama" in lines[-2]
    assert lines[-1].startswith("benchmark csv   benchmarks_out/tiny_llama.csv")


def test_a_plain_config_plans_without_notes_profiler_or_csv():
    text = format_plan(plan_summary(config()))
    assert text.startswith("world size") and "note:" not in text
    assert "profiler" not in text and "benchmark csv" not in text


# -- node-memory snapshots -------------------------------------------------------------------------
def test_the_plan_says_what_the_node_snapshots_take_per_rank_and_per_node():
    """Two slots of the heaviest rank's state (model-dtype parameters, fp32 masters, two fp32
    AdamW moments: 14 bytes a parameter in bf16), per node times the ranks the launch puts there."""
    cfg = load_config(REPO / "configs" / "llama7b_c4.yaml", check_paths=False)
    uid = os.getuid()
    plan = plan_summary(cfg, env={})
    n = plan["node_snapshots"]
    heaviest = max(e.parameters for e in plan["stages"])
    assert n.state_bytes == 14 * heaviest and n.slots == 2
    assert n.per_rank_bytes == 28 * heaviest and n.dir == f"/dev/shm/nanotron-recover-{uid}"
    assert n.ranks_per_node is None
    lines = format_plan(plan).splitlines()
    at = lines.index(
        f"node memory (recover.snapshot in /dev/shm/nanotron-recover-{uid}: "
        "2 slots of parameters, fp32 masters, AdamW moments):"
    )
    gib = 28 * heaviest / 2**30
    assert lines[at + 1] == f"  per rank      {gib:8.2f} GiB (2 x {gib / 2:.2f} GiB)"
    assert lines[at + 2] == (
        f"  per node      {4 * gib:8.2f} GiB with 4 ranks per node, {8 * gib:.2f} GiB with 8 "
        "(ranks per node not known here)"
    )
    # Inside a Slurm allocation: its ranks per node.
    for env, source in [
        ({"SLURM_NTASKS_PER_NODE": "8(x64)"}, "SLURM_NTASKS_PER_NODE"),
        ({"SLURM_GPUS_ON_NODE": "8"}, "SLURM_GPUS_ON_NODE"),
        ({"SLURM_GPUS_PER_NODE": "a100:8"}, "SLURM_GPUS_PER_NODE"),
    ]:
        text = format_plan(plan_summary(cfg, env=env))
        assert f"  per node      {8 * gib:8.2f} GiB (8 ranks per node, {source})" in text


def test_node_snapshots_of_an_hsdp_rank_a_small_job_a_cap_and_when_off():
    hsdp = plan_summary(load_config(REPO / "configs" / "llama7b_c4_hsdp.yaml", check_paths=False), env={})
    shard = hsdp["worst_stage"].parameters
    assert hsdp["node_snapshots"].state_bytes == 12 * shard  # fp32 shards (the masters) + moments
    # A job on one host: its world size is its ranks per node.
    small = config("recover.enabled=true", "parallelism.dp=2")
    text = format_plan(plan_summary(small, env={}))
    assert "GiB with 2 ranks per node (ranks per node not known here)" in text
    capped = format_plan(
        plan_summary(config("recover.enabled=true", "recover.snapshot.max_mb=0.001"), env={})
    )
    assert "over recover.snapshot.max_mb" in capped
    off = plan_summary(config("recover.enabled=true", "recover.snapshot.interval=0"), env={})
    assert off["node_snapshots"] is None
    assert "node memory     recover.snapshot off (interval 0)" in format_plan(off)
    assert plan_summary(config(), env={})["node_snapshots"] is None  # no forward recovery


def test_without_max_mb_the_plan_gives_the_default_cap_from_the_folders_free_space(monkeypatch, tmp_path):
    """Half the folder's free space over the two slots of every rank of a node: the cap each rank
    applies at its first snapshot, here from this host's free space (the nodes decide their own)."""
    from nanotron_recover import estimate
    from nanotron_recover.data_parallel.forward import snapshots

    assert estimate.SNAPSHOT_DEFAULT_SHARE == snapshots.DEFAULT_SHARE
    assert estimate.SNAPSHOT_SLOTS == snapshots.SLOTS
    cfg = load_config(REPO / "configs" / "llama7b_c4.yaml", check_paths=False)
    monkeypatch.setattr(estimate, "folder_free_bytes", lambda folder: 200 * 2**30)
    lines = format_plan(plan_summary(cfg, env={"SLURM_NTASKS_PER_NODE": "4"})).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  default cap"))
    assert lines[at] == (
        "  default cap   recover.snapshot.max_mb unset: 50% of the folder's free space over 2 slots "
        "x the ranks of a node, decided on each node at run time"
    )
    assert (
        lines[at + 1]
        == "                with the 200.00 GiB free here: 12.50 GiB a slot with 4 ranks per node"
    )
    # Not known where the ranks go: 4 and 8 per node; a slot of 10.98 GiB is over 6.25 GiB.
    text = format_plan(plan_summary(cfg, env={}))
    assert "12.50 GiB a slot with 4 ranks per node, 6.25 GiB a slot with 8 ranks per node " in text
    assert "(the heaviest rank's 10.98 GiB skipped)" in text
    monkeypatch.setattr(estimate, "folder_free_bytes", lambda folder: None)
    text = format_plan(plan_summary(cfg, env={}))
    assert "decided on each node at run time" in text and "free here" not in text
    capped = format_plan(
        plan_summary(
            load_config(
                REPO / "configs" / "llama7b_c4.yaml", ["recover.snapshot.max_mb=100000"], check_paths=False
            ),
            env={},
        )
    )
    assert "default cap" not in capped
    monkeypatch.undo()
    vfs = os.statvfs(tmp_path)
    assert estimate.folder_free_bytes(str(tmp_path / "not" / "yet")) == pytest.approx(
        vfs.f_bavail * vfs.f_frsize, rel=0.01
    )
