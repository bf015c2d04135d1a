"""What `pip install .` gives: the version the command reports."""
from __future__ import annotations

from importlib.metadata import version

import pytest

from services.cli import main


def test_version_prints_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == version("pdserve")
