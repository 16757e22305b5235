"""Reading: :class:`CheckpointReader` checks and loads a checkpoint saved with any layout.

Loading reassembles each full tensor from the saved shards (``ParamSpec.shard_dim``, split over the
saved tp) and cuts this rank's shard for the current layout, so tp, pp and dp may all differ from
the saved run. :meth:`CheckpointReader.verify` checks every shard file the saved layout implies
without loading a tensor. A damaged checkpoint gives a one-line CheckpointError naming the file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..config import LlamaConfig
from ..models.llama import LlamaStage
from ..parallel.sharding import ParamSpec, shard, unshard
from .errors import CheckpointError, _one_line
from .meta import FORMAT_VERSION, _read_meta
from .paths import _file, resolve


class CheckpointReader:
    """Reassembles full canonical tensors from a checkpoint saved with any layout."""

    def __init__(self, path: str | Path) -> None:
        self.path = resolve(path)
        self.meta = _read_meta(self.path)
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{self.path}: unsupported checkpoint format {self.meta.get('format_version')}"
            )
        self.saved_tp = int(self.meta["layout"]["tp"])
        self.saved_pp = int(self.meta["layout"]["pp"])

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def run_identity(self) -> str | None:
        """The saving run's :func:`run_identity`; None for checkpoints from before it was recorded."""
        return self.meta.get("run_identity")

    def _optimizer_keys(self) -> list[str]:
        return ["exp_avg", "exp_avg_sq"] + (["master"] if self.meta.get("dtype") != "float32" else [])

    def verify(self, rank: int | None = None) -> None:
        """Check the whole checkpoint without loading tensors: every shard file the saved layout
        implies opens, holds every expected entry with its expected shape (a truncated or corrupt
        file fails here), and this ``rank``'s RNG file, when present, loads."""
        expected: dict[str, dict[str, list[int]]] = {}
        for name, info in self.meta["tensors"].items():
            try:
                shape = [int(n) for n in info["full_shape"]]
                dim, stage = info["shard_dim"], int(info["stage"])
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{self.path / 'meta.json'}: corrupt entry for {name}") from e
            if dim is not None:
                shape[dim] //= self.saved_tp
            kinds = {"model": [None]}
            if self.meta.get("has_optimizer"):
                kinds["optimizer"] = self._optimizer_keys()
            for kind, keys in kinds.items():
                for t in range(self.saved_tp):
                    entries = expected.setdefault(_file(kind, stage, t), {})
                    for key in keys:
                        entries[name if key is None else f"{key}/{name}"] = shape
        for rel, entries in sorted(expected.items()):
            f = self.path / rel
            if not f.is_file():
                raise CheckpointError(f"{self.path}: missing {rel}")
            try:
                with safe_open(f, framework="pt") as handle:
                    stored = set(handle.keys())
                    for entry, shape in entries.items():
                        if entry not in stored:
                            raise CheckpointError(f"{f}: no entry {entry!r}")
                        got = list(handle.get_slice(entry).get_shape())
                        if got != shape:
                            raise CheckpointError(f"{f}: {entry} has shape {got}, expected {shape}")
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{f}: unreadable safetensors file ({_one_line(e)})") from e
        if rank is not None:
            self._read_rng(rank)

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
            try:
                with safe_open(f, framework="pt") as handle:
                    if stored not in handle.keys():
                        raise CheckpointError(f"{f}: no entry {stored!r}")
                    parts.append(handle.get_tensor(stored))
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{f}: unreadable safetensors file ({_one_line(e)})") from e
        spec = ParamSpec(tuple(info["full_shape"]), info["shard_dim"], name)
        try:
            full = unshard(parts, spec)
        except RuntimeError as e:
            raise CheckpointError(
                f"{self.path}: shards of {name} do not fit together ({_one_line(e)})"
            ) from e
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
        if (saved.get("num_key_value_heads") or saved.get("num_attention_heads")) != cfg.kv_heads:
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

    def check_optimizer(self) -> None:
        if not self.meta.get("has_optimizer"):
            raise CheckpointError(
                f"{self.path} has no optimizer state (converted weights?); set load_optimizer: false"
            )

    def load_optimizer_state(self, stage: LlamaStage) -> dict[str, dict[str, torch.Tensor]]:
        self.check_optimizer()
        keys = self._optimizer_keys()
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, spec in stage.specs.items():
            state[name] = {
                key: shard(self.full(spec.canonical_name, "optimizer", key), spec, stage.tp_rank, stage.tp)
                for key in keys
            }
        return state

    def _read_rng(self, rank: int) -> dict[str, torch.Tensor] | None:
        """This rank's saved RNG states; None when the file is absent (RNG state is optional)."""
        f = self.path / "rng" / f"rank{rank}.pt"
        if not f.is_file():
            return None
        try:
            rng = torch.load(f, weights_only=True)
            if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor):
                raise ValueError("no CPU RNG state")
        except Exception as e:
            raise CheckpointError(f"{f}: unreadable RNG state ({_one_line(e)})") from e
        return rng

    def load_rng(self, rank: int, world_size: int) -> None:
        """Restore this rank's RNG state when resuming on the same world size."""
        if self.meta.get("world_size") != world_size:
            return
        rng = self._read_rng(rank)
        if rng is None:
            return
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
