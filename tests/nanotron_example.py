"""Nanotron's own example config (``tests/data``) and the overrides it needs to validate here.

The example parses unchanged; these values are the ones it sets that this engine does not
implement (sequence parallelism, async TP communication, a non-shared checkpoint folder) and its
Hugging Face datasets, which are tokenized by ``preprocess`` here rather than on the fly.
"""

from __future__ import annotations

from pathlib import Path

NANOTRON = Path(__file__).resolve().parent / "data" / "nanotron_config_tiny_llama.yaml"

NANOTRON_FIXES = [
    "parallelism.tp_mode=ALL_REDUCE",
    "data_stages.0.data.dataset=null",
    "data_stages.1.data.dataset=null",
    "parallelism.tp_linear_async_communication=false",
    "checkpoints.checkpoints_path_is_shared_file_system=true",
]
