"""Layout-independent checkpoints: save on one tp/pp/dp layout, resume or evaluate on any other.

A checkpoint is a folder::

    step_<s>/meta.json                      step, layout, config, where each tensor lives
    step_<s>/model/pp<p>-tp<t>.safetensors      this (pp, tp) rank's shards, by canonical name
    step_<s>/optimizer/pp<p>-tp<t>.safetensors  exp_avg/<name>, exp_avg_sq/<name>, master/<name>
    step_<s>/rng/rank<r>.pt                     torch RNG states (restored when the world matches)
    latest                                      name of the newest complete step folder

Only data-parallel rank 0 writes model and optimizer shards (replicas are identical). The folder is
written as ``step_<s>.tmp`` and renamed once every rank is done, and ``latest`` is replaced
atomically after that, so a job killed while saving leaves the previous checkpoint intact.
Loading reassembles each full tensor from the saved shards (``ParamSpec.shard_dim``) and cuts this
rank's shard for the current layout, so tp, pp and dp may all differ from the saved run. The data
position and learning rate need no state of their own: both are pure functions of the step.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from .config import Config, LlamaConfig, dump_config
from .models.llama import LlamaStage, stage_layers
from .parallel.sharding import ParamSpec, shard, unshard

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    pass


def canonical_stage(name: str, cfg: LlamaConfig, pp: int) -> int:
    """Pipeline stage that saves the tensor ``name`` in a layout with ``pp`` stages."""
    if name.startswith("model.embed_tokens"):
        return 0
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        return next(p for p in range(pp) if layer in stage_layers(cfg.num_hidden_layers, pp, p))
    return pp - 1  # final norm and output head


def full_model_specs(cfg: LlamaConfig) -> dict[str, ParamSpec]:
    """Specs of every canonical tensor of the model, independent of layout."""
    return LlamaStage(cfg, device="meta").specs


def resolve(path: str | Path) -> Path:
    """A step folder, or a checkpoints root whose ``latest`` names one."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        step_dir = path / latest.read_text().strip()
        if (step_dir / "meta.json").is_file():
            return step_dir
        raise CheckpointError(f"{latest} names {step_dir.name}, which has no meta.json")
    raise CheckpointError(
        f"no checkpoint at {str(path)!r}: expected a step folder with meta.json or a 'latest' file"
    )


def latest_step(root: str | Path) -> int | None:
    try:
        return int(json.loads((resolve(root) / "meta.json").read_text())["step"])
    except CheckpointError:
        return None


def _file(kind: str, pp_rank: int, tp_rank: int) -> str:
    return f"{kind}/pp{pp_rank}-tp{tp_rank}.safetensors"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class PendingSave:
    """An asynchronous save in flight: its tensors are staged in CPU memory and a thread writes them."""

    def __init__(self, path: Path, thread: threading.Thread):
        self.path, self._thread = path, thread

    def wait(self) -> Path:
        self._thread.join()
        return self.path


def save_checkpoint(
    root: str | Path,
    step: int,
    cfg: Config,
    stage: LlamaStage,
    optimizer_state: dict[str, dict[str, torch.Tensor]] | None,
    *,
    tp: int,
    pp: int,
    dp_rank: int,
    extra: dict[str, Any] | None = None,
    asynchronous: bool = False,
) -> Path | PendingSave:
    """Collective over the whole world: every rank calls it with its own stage.

    The tensors are first staged: copied to CPU memory, synchronously, so training may change the
    model right after the call. Then each rank writes its files and drops a ``done/rank<r>`` marker;
    rank 0 waits for every marker, writes ``meta.json``, renames the folder and moves ``latest``.
    Synchronous saves return the final path once all that is done (a barrier); asynchronous ones
    return a ``PendingSave`` at once and write in a background thread, with no collective after
    staging. A caller must ``wait()`` for a pending save before starting the next one.
    """
    root = Path(root)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if rank == 0:
        for stale in root.glob("step_*.tmp"):  # left by a job killed while saving
            shutil.rmtree(stale, ignore_errors=True)
        for sub in ("model", "optimizer", "rng", "done"):
            (tmp / sub).mkdir(parents=True, exist_ok=True)
    _barrier()

    tensors: dict[str, torch.Tensor] = {}
    opt_tensors: dict[str, torch.Tensor] = {}
    if dp_rank == 0:
        params = dict(stage.named_parameters())
        for name, spec in stage.specs.items():
            if spec.is_tied_copy:
                continue  # the embedding on the first stage is the saved copy
            tensors[spec.canonical_name] = params[name].detach().cpu().contiguous().clone()
            for key, value in (optimizer_state or {}).get(name, {}).items():
                opt_tensors[f"{key}/{spec.canonical_name}"] = value.detach().cpu().contiguous().clone()
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    meta = _meta(cfg, step, tp, pp, world, optimizer_state is not None, extra) if rank == 0 else None
    pp_rank, tp_rank = stage.pp_rank, stage.tp_rank

    def write() -> None:
        if tensors:
            save_file(tensors, tmp / _file("model", pp_rank, tp_rank))
        if opt_tensors:
            save_file(opt_tensors, tmp / _file("optimizer", pp_rank, tp_rank))
        torch.save(rng, tmp / "rng" / f"rank{rank}.pt")
        (tmp / "done" / f"rank{rank}").touch()
        if rank == 0:
            _finalize(root, tmp, final, meta, world)

    if asynchronous:
        thread = threading.Thread(target=write, name=f"checkpoint-step{step}", daemon=True)
        thread.start()
        return PendingSave(final, thread)
    write()
    _barrier()
    return final


def _meta(
    cfg: Config, step: int, tp: int, pp: int, world: int, has_optimizer: bool, extra: dict | None
) -> dict:
    mcfg = cfg.model.model_config
    specs = full_model_specs(mcfg)
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "layout": {"tp": tp, "pp": pp, "dp": cfg.parallelism.dp},
        "world_size": world,
        "dtype": cfg.model.dtype,
        "has_optimizer": has_optimizer,
        "model_config": asdict(mcfg),
        "tensors": {
            name: {
                "full_shape": list(spec.full_shape),
                "shard_dim": spec.shard_dim,
                "stage": canonical_stage(name, mcfg, pp),
            }
            for name, spec in specs.items()
        },
        "config_yaml": dump_config(cfg),
        **(extra or {}),
    }


def _finalize(root: Path, tmp: Path, final: Path, meta: dict, world: int, timeout_s: float = 3600.0) -> None:
    """Rank 0: once every rank's files are written, publish the checkpoint atomically."""
    deadline = time.monotonic() + timeout_s
    while len(list((tmp / "done").iterdir())) < world:
        if time.monotonic() > deadline:
            raise CheckpointError(f"{tmp}: not every rank finished writing within {timeout_s:.0f}s")
        time.sleep(0.01)
    shutil.rmtree(tmp / "done")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")


class CheckpointReader:
    """Reassembles full canonical tensors from a checkpoint saved with any layout."""

    def __init__(self, path: str | Path):
        self.path = resolve(path)
        self.meta = json.loads((self.path / "meta.json").read_text())
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{self.path}: unsupported checkpoint format {self.meta.get('format_version')}"
            )
        self.saved_tp = self.meta["layout"]["tp"]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def full(self, name: str, kind: str = "model", key: str | None = None) -> torch.Tensor:
        """The full tensor ``name`` (model weights, or optimizer state ``key``)."""
        info = self.meta["tensors"].get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r} (is this checkpoint for the same model?)")
        stored = name if key is None else f"{key}/{name}"
        parts = []
        for t in range(self.saved_tp):
            f = self.path / _file(kind, info["stage"], t)
            if not f.is_file():
                raise CheckpointError(f"{self.path}: missing {f.relative_to(self.path)}")
            with safe_open(f, framework="pt") as handle:
                if stored not in handle.keys():
                    raise CheckpointError(f"{f}: no entry {stored!r}")
                parts.append(handle.get_tensor(stored))
        spec = ParamSpec(tuple(info["full_shape"]), info["shard_dim"], name)
        full = unshard(parts, spec)
        if list(full.shape) != info["full_shape"]:
            raise CheckpointError(
                f"{self.path}: {name} reassembles to {list(full.shape)}, expected {info['full_shape']}"
            )
        return full

    def check_model(self, cfg: LlamaConfig) -> None:
        saved = self.meta["model_config"]
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_hidden_layers",
            "vocab_size",
        ):
            if saved.get(key) != getattr(cfg, key):
                raise CheckpointError(
                    f"{self.path}: saved model has {key}={saved.get(key)}, config says {getattr(cfg, key)}"
                )
        if (saved.get("num_key_value_heads") or saved["num_attention_heads"]) != cfg.kv_heads:
            raise CheckpointError(f"{self.path}: saved model has a different num_key_value_heads")
        if saved.get("tie_word_embeddings") != cfg.tie_word_embeddings:
            raise CheckpointError(
                f"{self.path}: saved model has tie_word_embeddings={saved.get('tie_word_embeddings')}"
            )

    @torch.no_grad()
    def load_model(self, stage: LlamaStage) -> None:
        self.check_model(stage.cfg)
        params = dict(stage.named_parameters())
        for name, spec in stage.specs.items():
            full = self.full(spec.canonical_name)
            params[name].copy_(shard(full, spec, stage.tp_rank, stage.tp))

    def load_optimizer_state(self, stage: LlamaStage) -> dict[str, dict[str, torch.Tensor]]:
        if not self.meta.get("has_optimizer"):
            raise CheckpointError(
                f"{self.path} has no optimizer state (converted weights?); set load_optimizer: false"
            )
        keys = ["exp_avg", "exp_avg_sq"] + (["master"] if self.meta["dtype"] != "float32" else [])
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, spec in stage.specs.items():
            state[name] = {
                key: shard(self.full(spec.canonical_name, "optimizer", key), spec, stage.tp_rank, stage.tp)
                for key in keys
            }
        return state

    def load_rng(self, rank: int, world_size: int) -> None:
        """Restore this rank's RNG state when resuming on the same world size."""
        f = self.path / "rng" / f"rank{rank}.pt"
        if self.meta.get("world_size") == world_size and f.is_file():
            rng = torch.load(f, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
