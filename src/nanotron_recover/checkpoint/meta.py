"""The checkpoint format: ``meta.json``, written by every save and checked by every read.

``meta.json`` records the format version, the step, the layout the checkpoint was saved with (tp,
pp, dp and the world size), the dtype, whether optimizer state is present, the run identity
(``identity.py``), the ``save_id`` of the save that wrote it, the model config, the whole config as
YAML, the step the learning-rate schedule counts from, the fencing token of the job that saved it
(``fencing.py``), and for every canonical tensor its full
shape, its shard dimension and the pipeline stage (:func:`canonical_stage`) whose files hold it. A
reader needs nothing else to reassemble a tensor from the shards of any layout.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import fencing
from ..config import Config, LlamaConfig, dump_config
from .errors import CheckpointError, _one_line
from .identity import run_identity

if TYPE_CHECKING:
    from ..parallel.sharding import ParamSpec

FORMAT_VERSION = 1


def canonical_stage(name: str, cfg: LlamaConfig, pp: int) -> int:
    """Pipeline stage that saves the tensor ``name`` in a layout with ``pp`` stages."""
    if name.startswith("model.embed_tokens"):
        return 0
    if name.startswith("model.layers."):
        from ..models.llama import stage_layers  # torch: not for the readers of a step's metadata

        layer = int(name.split(".")[2])
        return next(p for p in range(pp) if layer in stage_layers(cfg.num_hidden_layers, pp, p))
    return pp - 1  # final norm and output head


def full_model_specs(cfg: LlamaConfig) -> dict[str, ParamSpec]:
    """Specs of every canonical tensor of the model, independent of layout."""
    from ..models.llama import LlamaStage

    return LlamaStage(cfg, device="meta").specs


def _meta(
    cfg: Config,
    step: int,
    tp: int,
    pp: int,
    world: int,
    has_optimizer: bool,
    extra: dict | None,
    save_id: int,
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
        "run_identity": run_identity(cfg),
        "save_id": save_id,
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
        # The step the learning-rate schedule counts from (see resumed_lr_schedule_origin).
        "lr_schedule_origin": cfg.lr_schedule_origin,
        # The fencing token of the job that saved it (fencing.py; null without one).
        "token": None if fencing.mine() is None else fencing.mine().as_record(),
        **(extra or {}),
    }


def _read_meta(step_dir: Path) -> dict[str, Any]:
    """``meta.json`` of a step folder, or a one-line CheckpointError naming it."""
    f = step_dir / "meta.json"
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: corrupt or truncated JSON ({_one_line(e)})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable ({_one_line(e)})") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{f}: corrupt (not a JSON object)")
    problem = None
    try:
        if not isinstance(meta["tensors"], dict) or not isinstance(meta["model_config"], dict):
            problem = "tensors or model_config is not an object"
        for value in (meta["step"], meta["layout"]["tp"], meta["layout"]["pp"]):
            if not isinstance(value, int):
                problem = f"{value!r} where a step, tp or pp number belongs"
    except (KeyError, TypeError) as e:
        problem = f"bad or missing {_one_line(e)}"
    if problem is not None:
        raise CheckpointError(f"{f}: incomplete or corrupt ({problem})")
    return meta
