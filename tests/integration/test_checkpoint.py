"""Checkpoints: asynchronous saves equal synchronous ones, publication is atomic, a save that fails
on any rank (full disk for real, injected errors, a rank that never finishes) is abandoned on every
rank without waiting for a deadline and leaves the previous checkpoint in force, damaged checkpoints
give one-line errors naming the file, and a run resumes automatically only from its own checkpoints.

Single process, except one test that runs a gloo world of two ranks."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from nanotron_recover.checkpoint import (
    CheckpointError,
    CheckpointIOError,
    CheckpointReader,
    CheckpointTimeoutError,
    PendingSave,
    find_resume_checkpoint,
    latest_step,
    resolve,
    run_identity,
    save_checkpoint,
)
from nanotron_recover.checkpoint import save as checkpoint_save
from nanotron_recover.config import (
    CheckpointsArgs,
    Config,
    LlamaConfig,
    ModelArgs,
    ParallelismArgs,
    RecoverArgs,
)
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


# -- a large save and the failure watch --------------------------------------------------------
GIB = 2**30
# A heartbeat or failure-watch thread must keep running while a checkpoint is written: ULFM's
# detector declares a rank dead after recover.heartbeat_timeout_s (5 s by default) without progress.
# That timeout is the bound: a behaviour (the GIL is released while writing), not a speed target. A
# machine busy with other work stalls a thread for seconds now and then (3.2 s seen at a load of 12
# on 2 cores), and a save of 2.9 GiB holding the GIL (torch.save: about 2 s per GiB) stalls it longer.
MAX_TICK_GAP_S = RecoverArgs().heartbeat_timeout_s


def _available_ram() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_a_large_save_does_not_starve_a_python_thread(tmp_path):
    """2.9 GiB of parameters through save_checkpoint while a thread ticks every 10 ms, as the
    failure watch polls: the longest gap between ticks stays below the heartbeat timeout (writing
    them with the GIL held, as torch.save does at about 2 s per GiB, would not).
    safetensors (>= 0.8) writes with the GIL released; torch.save writes only the small RNG state."""
    ram, disk = _available_ram(), shutil.disk_usage(tmp_path).free
    if ram < 8 * GIB or disk < 8 * GIB:
        pytest.skip(
            f"needs 8 GiB of free RAM and disk, has {ram / GIB:.1f} GiB RAM, {disk / GIB:.1f} GiB disk"
        )
    mcfg = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_hidden_layers=10,
        vocab_size=65536,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    cfg = Config(model=ModelArgs(model_config=mcfg, dtype="float32"))
    stage = LlamaStage(mcfg)
    with torch.no_grad():
        for p in stage.parameters():
            p.fill_(0.01)
    nbytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    assert nbytes > 2.8 * GIB

    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        path = save_checkpoint(tmp_path, 1, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    finally:
        done.set()
        ticker.join()

    assert latest_step(tmp_path) == 1 and path == tmp_path / "step_1"
    written = sum(f.stat().st_size for f in (path / "model").iterdir())
    assert written >= nbytes  # the whole model went through the writer, as safetensors
    assert len(gaps) > 10
    assert max(gaps) < MAX_TICK_GAP_S, f"a 10 ms ticker stalled {max(gaps):.2f}s during the save"


def test_reader_round_trips_weights(tmp_path):
    cfg, stage = tiny()
    save_checkpoint(tmp_path, 1, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    other = LlamaStage(cfg.model.model_config)
    CheckpointReader(tmp_path).load_model(other)
    for (n, a), (_, b) in zip(stage.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(a, b), n


# -- failures while saving ---------------------------------------------------------------------


def checkpoint_bytes(path: Path) -> int:
    """Space a checkpoint takes on tmpfs: every file rounded up to whole pages."""
    return sum(-(-f.stat().st_size // 4096) * 4096 for f in path.rglob("*") if f.is_file())


@pytest.fixture
def small_disk(tmp_path: Path):
    """A tmpfs with room for one checkpoint of ``tiny()`` (and meta files), not for two."""
    cfg, stage = tiny()
    probe = save_checkpoint(tmp_path / "probe", 2, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    size_k = (checkpoint_bytes(probe) * 3 // 2) // 1024
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_k}k", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
        why = mounted.stderr.strip() if mounted.returncode != 0 else None
    except OSError as e:
        why = str(e)
    if why is not None:
        pytest.skip(f"cannot mount a small tmpfs to fill up (needs root and mount): {why}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def assert_one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


def assert_first_checkpoint_intact(root: Path, stage: LlamaStage) -> None:
    assert not list(root.glob("step_*.tmp")), "a failed save leaves no tmp folder behind"
    assert (root / "latest").read_text() == "step_2"
    CheckpointReader(root).verify(rank=0)
    assert_loads_like(root, stage)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_full_disk_keeps_previous_checkpoint(small_disk: Path, asynchronous: bool):
    cfg, stage = tiny()
    save_checkpoint(small_disk, 2, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    with pytest.raises(CheckpointIOError) as caught:
        saved = save_checkpoint(
            small_disk, 4, cfg, stage, None, tp=1, pp=1, dp_rank=0, asynchronous=asynchronous
        )
        if asynchronous:
            assert isinstance(saved, PendingSave)
            try:
                saved.wait(timeout_s=60)
            finally:
                assert saved.done and isinstance(saved.error, CheckpointIOError)
    text = assert_one_line(caught.value)
    shard = small_disk / "step_4.tmp" / "model" / "pp0-tp0.safetensors"
    assert text == f"checkpoint step 4 not saved: {shard}: No space left on device"
    assert caught.value.errno == errno.ENOSPC and caught.value.path == str(shard)
    assert_first_checkpoint_intact(small_disk, stage)


def test_failed_async_save_keeps_its_error(tmp_path, monkeypatch):
    cfg, stage = tiny()

    def refuse(obj, path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint_save, "_torch_save", refuse)
    pending = save_checkpoint(tmp_path, 3, cfg, stage, None, tp=1, pp=1, dp_rank=0, asynchronous=True)
    assert isinstance(pending, PendingSave)
    with pytest.raises(CheckpointIOError) as first:
        pending.wait(timeout_s=60)
    with pytest.raises(CheckpointIOError) as again:
        pending.poll()
    assert first.value is again.value is pending.error
    assert (
        str(first.value)
        == f"checkpoint step 3 not saved: {tmp_path}/step_3.tmp/rng/rank0.pt: Permission denied"
    )
    assert not (tmp_path / "step_3.tmp").exists() and not (tmp_path / "latest").exists()


def test_pending_save_poll_and_timeout(tmp_path, monkeypatch):
    cfg, stage = tiny()
    release = threading.Event()
    original = checkpoint_save._torch_save

    def slow(obj, path):
        release.wait(30)
        original(obj, path)

    monkeypatch.setattr(checkpoint_save, "_torch_save", slow)
    pending = save_checkpoint(tmp_path, 5, cfg, stage, None, tp=1, pp=1, dp_rank=0, asynchronous=True)
    assert pending.poll() is None and not pending.done and pending.error is None
    with pytest.raises(CheckpointTimeoutError):
        pending.wait(timeout_s=0.05)
    release.set()
    assert pending.wait(timeout_s=30) == tmp_path / "step_5"
    assert pending.poll() == tmp_path / "step_5" and pending.error is None
    assert latest_step(tmp_path) == 5


def test_same_step_saved_again_replaces_it(tmp_path):
    cfg, stage = tiny()
    save_checkpoint(tmp_path, 4, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    with torch.no_grad():
        for p in stage.parameters():
            p.add_(1.0)
    save_checkpoint(tmp_path, 4, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_4"]
    assert_loads_like(tmp_path, stage)


def steps_on_disk(root: Path) -> list[int]:
    return sorted(
        int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_") and p.name[5:].isdigit()
    )


@pytest.mark.parametrize("asynchronous", [False, True])
def test_keep_last_retires_older_checkpoints_after_each_publication(tmp_path, asynchronous):
    cfg, stage = tiny()
    cfg = replace(cfg, checkpoints=replace(cfg.checkpoints, keep_last=3))
    for step in (10, 20, 30, 40, 50):
        saved = save_checkpoint(
            tmp_path, step, cfg, stage, None, tp=1, pp=1, dp_rank=0, asynchronous=asynchronous
        )
        if asynchronous:
            saved.wait()
        assert steps_on_disk(tmp_path) == [s for s in (10, 20, 30, 40, 50) if s <= step][-3:]
    assert latest_step(tmp_path) == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_30", "step_40", "step_50"]
    assert_loads_like(tmp_path, stage)


def test_without_keep_last_every_checkpoint_stays(tmp_path):
    cfg, stage = tiny()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    assert steps_on_disk(tmp_path) == [1, 2, 3]


def test_keep_last_never_removes_newer_checkpoints_than_the_one_published(tmp_path):
    """Resumed by hand from an older checkpoint, a run publishes steps below checkpoints it saved
    before: those are another branch's, and stay; only older ones are retired."""
    cfg, stage = tiny()
    keep = replace(cfg, checkpoints=replace(cfg.checkpoints, keep_last=2))
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    save_checkpoint(tmp_path, 25, keep, stage, None, tp=1, pp=1, dp_rank=0)
    assert steps_on_disk(tmp_path) == [20, 25, 30, 40]
    assert latest_step(tmp_path) == 25


def test_a_writer_fenced_off_the_run_retires_nothing(tmp_path):
    from nanotron_recover import fencing
    from nanotron_recover.checkpoint.publish import _retire_older

    cfg, stage = tiny()
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        save_checkpoint(root, step, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    old = fencing.advance(tmp_path, "aaaa")
    fencing.set_mine(old, tmp_path)
    try:
        fencing.advance(tmp_path)  # a newer job owns the run now
        assert _retire_older(root, root / "step_4", keep_last=2) == []
        assert steps_on_disk(root) == [1, 2, 3, 4]
        fencing.set_mine(fencing.read_token(tmp_path), tmp_path)  # the current job's writer
        assert [p.name for p in _retire_older(root, root / "step_4", keep_last=2)] == ["step_1", "step_2"]
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_3", "step_4"]
    finally:
        fencing._adopted, fencing._mine, fencing._run_dir = False, None, None


def test_a_writer_fenced_in_the_middle_of_a_retirement_renames_nothing_more(tmp_path, monkeypatch):
    """Stopped between two renames while a newer job took the run over: it stops at the next one."""
    from nanotron_recover import fencing
    from nanotron_recover.checkpoint import publish

    cfg, stage = tiny()
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(tmp_path, step, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    checks = []

    def guard(what: str) -> None:
        checks.append(what)
        if len(checks) > 2:  # the first look and the first folder pass; then the job is fenced
            raise fencing.Fenced(f"not writing {what}")

    monkeypatch.setattr(fencing, "guard_adopted", guard)
    assert [p.name for p in publish._retire_older(tmp_path, tmp_path / "step_5", keep_last=2)] == ["step_1"]
    assert steps_on_disk(tmp_path) == [2, 3, 4, 5]


def test_keep_last_never_retires_what_the_config_names_another_run_or_an_unreadable_one(tmp_path):
    """``resume_checkpoint_path`` (a relaunch and every re-join read it again), a checkpoint of
    another run kept in the same folder, and one whose ``meta.json`` cannot be read all stay."""
    cfg, stage = tiny()
    for step in (10, 20):
        save_checkpoint(tmp_path, step, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    other = tmp_path / "step_5"
    shutil.copytree(tmp_path / "step_10", other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "run_identity": "another-run"}))
    shutil.copytree(tmp_path / "step_10", tmp_path / "step_7")
    (tmp_path / "step_7" / "meta.json").write_text("{not json")
    resumed = replace(
        cfg, checkpoints=replace(cfg.checkpoints, keep_last=2, resume_checkpoint_path=tmp_path / "step_20")
    )
    for step in (30, 40, 50):
        save_checkpoint(tmp_path, step, resumed, stage, None, tp=1, pp=1, dp_rank=0)
    assert steps_on_disk(tmp_path) == [5, 7, 20, 40, 50]
    assert CheckpointReader(tmp_path / "step_20").step == 20


def test_retired_folders_are_removed_within_a_budget_and_never_match_a_step_pattern(tmp_path):
    from nanotron_recover.checkpoint.publish import RETIRED_PREFIX, _retire_older

    cfg, stage = tiny()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, cfg, stage, None, tp=1, pp=1, dp_rank=0)
    retired = _retire_older(tmp_path, tmp_path / "step_4", keep_last=2, budget_s=-1)  # no time to remove
    assert [p.name for p in retired] == ["step_1", "step_2"]
    trash = sorted(p.name for p in tmp_path.glob(f"{RETIRED_PREFIX}*"))
    assert [t.rsplit("-", 1)[0] for t in trash] == ["retired-step_1", "retired-step_2"]
    assert not list(tmp_path.glob("step_*.tmp")) and latest_step(tmp_path) == 4
    save_checkpoint(
        tmp_path,
        5,
        replace(cfg, checkpoints=replace(cfg.checkpoints, keep_last=2)),
        stage,
        None,
        tp=1,
        pp=1,
        dp_rank=0,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_4", "step_5"]


def assert_loads_like(root: Path, stage: LlamaStage) -> None:
    other = LlamaStage(stage.cfg)
    CheckpointReader(root).load_model(other)
    for (n, a), (_, b) in zip(stage.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(a, b), n


# -- two ranks: one failing rank never leaves the others waiting ---------------------------------


def _two_rank_worker(rank: int, store: str, root: str) -> None:
    """Each scenario on both ranks of a gloo world; an assertion failing here fails the test."""
    import datetime

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:
        _two_rank_scenarios(rank, Path(root))
    except BaseException:
        # The peer of a failing rank dies of a closed connection: keep each rank's own story.
        Path(f"{root}.rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _two_rank_scenarios(rank: int, root: Path) -> None:
    cfg, stage = tiny()
    cfg = replace(cfg, parallelism=ParallelismArgs(dp=2))
    kw = {"tp": 1, "pp": 1, "dp_rank": rank}
    original = checkpoint_save._torch_save

    def full_disk(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    def save(step: int, failing: int | None, asynchronous: bool, timeout_s: float = 60.0, fault=full_disk):
        checkpoint_save._torch_save = fault if rank == failing else original
        try:
            t0 = time.monotonic()
            try:
                saved = save_checkpoint(
                    root,
                    step,
                    cfg,
                    stage,
                    None,
                    **kw,
                    asynchronous=asynchronous,
                    finalize_timeout_s=timeout_s,
                )
                if isinstance(saved, PendingSave):
                    saved = saved.wait(timeout_s=120)
                return saved, None, time.monotonic() - t0
            except CheckpointError as e:
                return None, e, time.monotonic() - t0
        finally:
            checkpoint_save._torch_save = original
            dist.barrier()  # both ranks see the outcome on disk before the next scenario

    path, error, _ = save(2, None, asynchronous=False)
    assert error is None and path == root / "step_2"
    path, error, _ = save(3, None, asynchronous=True)
    assert error is None and path == root / "step_3" and latest_step(root) == 3
    rank1_rng = f"{root}/step_4.tmp/rng/rank1.pt"
    rank0_rng = f"{root}/step_5.tmp/rng/rank0.pt"
    expected = {
        # Synchronous, rank 1 fails: both ranks raise rank 1's error.
        (4, 1, False): f"checkpoint step 4 not saved: {rank1_rng}: No space left on device",
        # Asynchronous, rank 1 fails: rank 0 stops waiting at once and abandons.
        (4, 1, True): f"checkpoint step 4 not saved: {rank1_rng}: No space left on device",
        # Asynchronous, rank 0 fails: rank 1 gets rank 0's verdict.
        (5, 0, True): f"checkpoint step 5 not saved: {rank0_rng}: No space left on device",
    }
    for (step, failing, asynchronous), message in expected.items():
        path, error, took = save(step, failing, asynchronous)
        assert isinstance(error, CheckpointIOError), (rank, step, failing, asynchronous, error)
        assert str(error) == message, (rank, str(error))
        assert took < 15, f"a failed save took {took:.1f}s: something waited for a deadline"
        assert latest_step(root) == 3, (rank, step, sorted(p.name for p in root.iterdir()))
        assert not (root / f"step_{step}.tmp").exists(), (rank, step)
        dist.barrier()  # both checked before the next save changes the folder

    # A rank that never finishes: rank 0 gives up at the deadline, and both report the same.
    def stuck(obj, path):
        time.sleep(4)
        original(obj, path)

    path, error, took = save(6, 1, asynchronous=True, timeout_s=1.0, fault=stuck)
    assert type(error) is CheckpointError and "rank(s) 1 did not finish writing" in str(error), error
    assert (took < 3) if rank == 0 else (took < 10), took
    assert latest_step(root) == 3 and not (root / "step_6").exists()
    dist.barrier()

    path, error, _ = save(8, None, asynchronous=True)
    assert error is None and latest_step(root) == 8
    CheckpointReader(root).verify(rank=rank)


@pytest.mark.mpi
def test_two_ranks_agree_on_failed_saves(tmp_path):
    # fork: the ranks start in a fraction of the time spawn takes (CPU only, no CUDA state to lose).
    ranks = mp.start_processes(
        _two_rank_worker,
        args=(str(tmp_path / "store"), str(tmp_path / "ck")),
        nprocs=2,
        join=False,
        start_method="fork",
    )
    deadline = time.monotonic() + 180
    try:
        while not ranks.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("the two ranks did not finish within 180s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        stories = "\n".join(f.read_text() for f in sorted(tmp_path.glob("ck.rank*.error")))
        pytest.fail(f"a rank failed:\n{stories}")
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()


# -- damaged checkpoints --------------------------------------------------------------------------


def saved(tmp_path: Path, optimizer: bool = True) -> tuple[Config, LlamaStage, Path]:
    cfg, stage = tiny()
    save_checkpoint(tmp_path, 2, cfg, stage, opt_state(stage) if optimizer else None, tp=1, pp=1, dp_rank=0)
    return cfg, stage, tmp_path / "step_2"


def test_corrupt_meta_json(tmp_path):
    _, _, step_dir = saved(tmp_path)
    meta = step_dir / "meta.json"
    meta.write_text(meta.read_text()[:100])  # truncated
    with pytest.raises(CheckpointError) as caught:
        CheckpointReader(tmp_path)
    assert assert_one_line(caught.value).startswith(f"{meta}: corrupt or truncated JSON (")
    with pytest.raises(CheckpointError, match="meta.json: corrupt"):
        latest_step(tmp_path)
    meta.write_text('{"step": 2}')
    with pytest.raises(CheckpointError) as caught:
        CheckpointReader(step_dir)
    assert assert_one_line(caught.value).startswith(f"{meta}: incomplete or corrupt")


@pytest.mark.parametrize("kind", ["model", "optimizer"])
def test_truncated_shard(tmp_path, kind):
    _, stage, step_dir = saved(tmp_path)
    shard_file = step_dir / kind / "pp0-tp0.safetensors"
    os.truncate(shard_file, shard_file.stat().st_size // 2)
    reader = CheckpointReader(tmp_path)  # meta.json alone is fine
    with pytest.raises(CheckpointError) as caught:
        reader.verify()
    assert assert_one_line(caught.value).startswith(f"{shard_file}: unreadable safetensors file (")
    with pytest.raises(CheckpointError) as caught:
        if kind == "model":
            reader.load_model(LlamaStage(stage.cfg))
        else:
            reader.load_optimizer_state(LlamaStage(stage.cfg))
    assert assert_one_line(caught.value).startswith(f"{shard_file}: unreadable safetensors file (")


def test_missing_shard_and_entry(tmp_path):
    _, _, step_dir = saved(tmp_path)
    shard_file = step_dir / "optimizer" / "pp0-tp0.safetensors"
    tensors = load_file(shard_file)
    del tensors["exp_avg/model.norm.weight"]
    save_file(tensors, shard_file)
    with pytest.raises(CheckpointError) as caught:
        CheckpointReader(tmp_path).verify()
    assert str(caught.value) == f"{shard_file}: no entry 'exp_avg/model.norm.weight'"
    shard_file.unlink()
    with pytest.raises(CheckpointError) as caught:
        CheckpointReader(tmp_path).verify()
    assert str(caught.value) == f"{step_dir}: missing optimizer/pp0-tp0.safetensors"


def test_rng_file_is_optional_but_must_not_be_damaged(tmp_path):
    _, _, step_dir = saved(tmp_path)
    rng = step_dir / "rng" / "rank0.pt"
    rng.write_bytes(rng.read_bytes()[:50])
    with pytest.raises(CheckpointError) as caught:
        CheckpointReader(tmp_path).verify(rank=0)
    assert assert_one_line(caught.value).startswith(f"{rng}: unreadable RNG state (")
    rng.unlink()
    reader = CheckpointReader(tmp_path)
    reader.verify(rank=0)
    reader.load_rng(0, 1)  # nothing to restore, nothing raised


def test_latest_naming_a_missing_or_incomplete_folder(tmp_path):
    _, _, step_dir = saved(tmp_path)
    latest = tmp_path / "latest"
    latest.write_text("step_9")
    for call in (CheckpointReader, latest_step, lambda p: find_resume_checkpoint(tiny()[0], p)):
        with pytest.raises(CheckpointError) as caught:
            call(tmp_path)
        assert assert_one_line(caught.value) == f"{latest}: names step_9, which does not exist"
    (tmp_path / "step_9" / "model").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="names step_9, which is incomplete"):
        latest_step(tmp_path)


def test_unfinished_save_is_never_a_checkpoint(tmp_path):
    cfg, stage, step_dir = saved(tmp_path)
    # A save killed after rank 0 wrote meta.json, before publication.
    shutil.copytree(step_dir, tmp_path / "step_4.tmp")
    assert latest_step(tmp_path) == 2
    with pytest.raises(CheckpointError, match="unfinished save"):
        CheckpointReader(tmp_path / "step_4.tmp")
    # Without `latest` (killed between the renames of the first save), the newest complete step.
    (tmp_path / "latest").unlink()
    shutil.copytree(step_dir, tmp_path / "step_3")
    assert find_resume_checkpoint(cfg, tmp_path).path == tmp_path / "step_3"


# -- run identity and resuming ----------------------------------------------------------------------


def test_run_identity_ignores_layout_and_length_only():
    cfg, _ = tiny()
    base = run_identity(cfg)
    assert len(base) == 16 and int(base, 16) >= 0
    tokens = cfg.tokens
    same = [
        replace(cfg, parallelism=ParallelismArgs(tp=2, pp=2, pp_engine="afab")),
        replace(cfg, tokens=replace(tokens, train_steps=tokens.train_steps + 100)),
        replace(cfg, checkpoints=CheckpointsArgs(checkpoints_path=Path("/elsewhere"), checkpoint_interval=7)),
        replace(cfg, general=replace(cfg.general, run="renamed", project="other")),
    ]
    two_g = replace(cfg, tokens=replace(tokens, batch_accumulation_per_replica=2))
    assert run_identity(two_g) == run_identity(
        replace(
            cfg, parallelism=ParallelismArgs(dp=2), tokens=replace(tokens, batch_accumulation_per_replica=1)
        )
    ), "dp=1 x G=2 and dp=2 x G=1 sum the same micro-batches per step"
    for other in same:
        assert run_identity(other) == base
    sched = cfg.optimizer.learning_rate_scheduler
    different = [
        replace(cfg, model=replace(cfg.model, model_config=replace(cfg.model.model_config, hidden_size=64))),
        replace(
            cfg,
            optimizer=replace(cfg.optimizer, learning_rate_scheduler=replace(sched, learning_rate=1e-3)),
        ),
        replace(cfg, general=replace(cfg.general, seed=cfg.general.seed + 1)),
        two_g,  # B doubles
        replace(cfg, tokens=replace(tokens, sequence_length=tokens.sequence_length * 2)),
    ]
    identities = {run_identity(c) for c in different}
    assert base not in identities and len(identities) == len(different)


def test_find_resume_checkpoint(tmp_path):
    cfg, stage = tiny()
    assert find_resume_checkpoint(cfg, tmp_path / "nothing") is None
    assert find_resume_checkpoint(cfg, tmp_path) is None
    save_checkpoint(tmp_path, 2, cfg, stage, opt_state(stage), tp=1, pp=1, dp_rank=0)
    own = find_resume_checkpoint(cfg, tmp_path, rank=0)
    assert own is not None and own.step == 2 and own.run_identity == run_identity(cfg)
    # Resuming on another layout keeping B is the same run.
    relaid = replace(cfg, parallelism=ParallelismArgs(dp=1, tp=2))
    assert find_resume_checkpoint(relaid, tmp_path).step == 2

    other = replace(cfg, general=replace(cfg.general, seed=cfg.general.seed + 1))
    with pytest.raises(CheckpointError) as caught:
        find_resume_checkpoint(other, tmp_path)
    assert assert_one_line(caught.value) == (
        f"{tmp_path / 'step_2'}: checkpoint belongs to another run (identity {run_identity(cfg)} != "
        f"{run_identity(other)}); use another checkpoints_path, or name it in "
        "checkpoints.resume_checkpoint_path to resume it anyway"
    )
    explicit = replace(other, checkpoints=replace(other.checkpoints, resume_checkpoint_path=tmp_path))
    assert find_resume_checkpoint(explicit, tmp_path / "unused").step == 2

    # A checkpoint from before identities were recorded: only when named explicitly.
    meta_file = tmp_path / "step_2" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["run_identity"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"another run \(identity unrecorded != "):
        find_resume_checkpoint(cfg, tmp_path)
    named = replace(cfg, checkpoints=replace(cfg.checkpoints, resume_checkpoint_path=tmp_path / "step_2"))
    assert find_resume_checkpoint(named, tmp_path).step == 2

    # Explicit still refuses another model shape, and damage is found before anything is loaded.
    bigger = replace(
        named, model=replace(cfg.model, model_config=replace(cfg.model.model_config, vocab_size=128))
    )
    with pytest.raises(CheckpointError, match="vocab_size=64, config says 128"):
        find_resume_checkpoint(bigger, tmp_path)
    os.truncate(tmp_path / "step_2" / "model" / "pp0-tp0.safetensors", 100)
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        find_resume_checkpoint(named, tmp_path)


def test_resume_without_optimizer_state_is_refused_early(tmp_path):
    cfg, _, _ = saved(tmp_path, optimizer=False)
    with pytest.raises(CheckpointError, match="has no optimizer state"):
        find_resume_checkpoint(cfg, tmp_path)
    weights_only = replace(cfg, checkpoints=replace(cfg.checkpoints, load_optimizer=False))
    assert find_resume_checkpoint(weights_only, tmp_path).step == 2
