"""The graphpass pytest plugin (loaded by the ``pytest11`` entry point when graphpass is installed).

* ``--graphpass-update-golden``: golden files (:func:`graphpass.testing.assert_golden`, and
  ``assert_parity(golden_dir=...)``) are rewritten instead of compared.
* ``graphpass_ranks``: a fixture returning ``get(world_size) -> RankPool``: live local ranks, one
  pool per world size, kept for the whole session so every test pays each rank's start-up (spawn,
  imports, first capture) once. A run that fails or outlives its timeout kills all its ranks and
  raises with the failing rank's traceback; the pool starts fresh ranks on its next run.
  ``graphpass_rank_initializer`` (a session fixture to override): a function each rank runs once.
"""

from __future__ import annotations

import os

import pytest

from graphpass.testing.golden import UPDATE_ENV


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graphpass")
    group.addoption("--graphpass-update-golden", action="store_true", default=False,
                    help="rewrite graphpass golden files instead of comparing with them")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--graphpass-update-golden", default=False):
        # Ranks and in-process checks read the variable; the flag wins over an exported 0, and
        # the old value comes back when the session ends.
        config._graphpass_old_update = os.environ.get(UPDATE_ENV)  # type: ignore[attr-defined]
        os.environ[UPDATE_ENV] = "1"


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "_graphpass_old_update"):
        old = config._graphpass_old_update  # type: ignore[attr-defined]
        if old is None:
            os.environ.pop(UPDATE_ENV, None)
        else:
            os.environ[UPDATE_ENV] = old


@pytest.fixture(scope="session")
def graphpass_rank_initializer():
    """The ``RankPool(initializer=)`` of ``graphpass_ranks``' pools: none. Override it in a
    ``conftest.py`` (session scope) to give every rank shared set-up."""
    return None


@pytest.fixture(scope="session")
def graphpass_ranks(graphpass_rank_initializer):
    """``get(world_size) -> RankPool``, one live pool per world size for the session."""
    from graphpass.runtime.launch import RankPool

    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size, initializer=graphpass_rank_initializer)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
