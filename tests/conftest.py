"""The fixtures: one token cache per session, a one-rank process group per module (tests/helpers.py
has the shared helpers)."""

from __future__ import annotations

import pytest

from tests.helpers import one_rank_pg


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One token cache for the whole session: the corpus is tokenized once."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo process group (FSDP and DCP need one), for the whole module."""
    with one_rank_pg():
        yield
