"""A plain install, inside this test process: the gigatoken package is not found."""

from __future__ import annotations

import pytest

from gateway.count.tokenizers import vocab


def hide_gigatoken(patch: pytest.MonkeyPatch) -> None:
    """Make ``vocab`` find no gigatoken, as ``pip install shapegate`` without the extra has it."""
    real = vocab.importlib.util.find_spec
    patch.setattr(
        vocab.importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "gigatoken" else real(name, *rest),
    )
