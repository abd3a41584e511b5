"""The fixtures: one token cache per session, a one-rank process group per module, and each test's
environment put back after it (tests/helpers.py has the shared helpers)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shardwise.runtime.machine import environment_kept
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


@pytest.fixture(autouse=True)
def _environment_put_back() -> Iterator[None]:
    """A variable a test's in-process code leaves in os.environ (torch's compile cache, say) would
    reach every later test's commands, and make each of them miss the CLI fork server (it forks
    only into its own environment: tests/helpers.run_cli) and start a fresh interpreter."""
    with environment_kept():
        yield
