"""Configs written like Nanotron's examples (``tests/data``), for the tests that read them.

``NANOTRON`` is a debug-sized LLaMA in Nanotron's layout (every section, keys sorted, defaults
spelled out) that loads unchanged; ``NANOTRON_CONFIGS`` holds one config per kind of Nanotron
example this engine trains (see tests/unit/config/test_nanotron_configs.py). All were written for this project.
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
NANOTRON = DATA / "nanotron_config_tiny_llama.yaml"
NANOTRON_DIR = DATA / "nanotron"
NANOTRON_CONFIGS = sorted(NANOTRON_DIR.glob("*.yaml"))
