"""lazy_names.py: a package's names imported on first use, and only then."""

from __future__ import annotations

import pytest

from nanotron_recover.lazy_names import lazy_names
from tests.helpers.python_probe import probe_stdout


def test_a_name_comes_from_its_module_and_an_unknown_one_is_an_attribute_error():
    getattr_ = lazy_names("nanotron_recover.checkpoint", {"run_identity": ".identity"})
    from nanotron_recover.checkpoint.identity import run_identity

    assert getattr_("run_identity") is run_identity
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        getattr_("nothing")


def test_the_packages_load_torch_only_when_a_heavy_name_is_asked_for():
    probe = (
        "import sys\n"
        "import nanotron_recover.checkpoint, nanotron_recover.data_parallel, nanotron_recover.ft\n"
        "from nanotron_recover.checkpoint import run_identity\n"
        "print('before', 'torch' in sys.modules, 'mpi4py.MPI' in sys.modules)\n"
        "from nanotron_recover.checkpoint import save_checkpoint\n"
        "print('after', 'torch' in sys.modules)\n"
    )
    out = probe_stdout(probe)
    assert "before False False" in out and "after True" in out, out
