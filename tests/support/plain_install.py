"""A plain install, inside this test process: the gigatoken package is not found."""

from __future__ import annotations

import pytest

from gateway.count.tokenizers import backends


def hide_gigatoken(patch: pytest.MonkeyPatch) -> None:
    """Make ``backends`` find no gigatoken, as ``pip install shapegate`` without the extra does."""
    real = backends.importlib.util.find_spec
    patch.setattr(
        backends.importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "gigatoken" else real(name, *rest),
    )
