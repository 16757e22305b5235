"""nanotron-recover: 3D-parallel LLaMA pre-training that repairs faults forward, inside the step."""

__version__ = "0.1.0"
