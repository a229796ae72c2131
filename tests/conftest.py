"""Shared pytest fixtures for graphpass tests."""

from __future__ import annotations

# ======================================================================================
# BEGIN multi-rank pools (owner: runtime/launch.py)
#
# `rank_pool` hands out one live RankPool per world size for the whole session, so the suite
# pays each rank's start-up once: the spawn, the imports (transformers), the first export of each
# model class (1-8 s per pool on 2 cores at 4 ranks). Functions run on the ranks must be
# module-level and leave the rank as they found it (restore what they patch).
# ======================================================================================
import pathlib
import sys

import pytest

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

# `import gpt` (and the other example scripts) from tests; ranks inherit sys.path, so the
# examples import there too.
if str(_REPO_ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT / "examples"))

pytest_plugins = ["pytester"]


@pytest.fixture(scope="session", autouse=True)
def _isolated_profile_cache(tmp_path_factory):
    """Tests never read or write the user's profiles (~/.cache/graphpass): a profile there would
    change what Cluster.local() and the planner see. Ranks inherit the variable."""
    import os

    old = os.environ.get("GRAPHPASS_CACHE_DIR")
    os.environ["GRAPHPASS_CACHE_DIR"] = str(tmp_path_factory.mktemp("graphpass-cache"))
    yield
    if old is None:
        os.environ.pop("GRAPHPASS_CACHE_DIR", None)
    else:
        os.environ["GRAPHPASS_CACHE_DIR"] = old


def pytest_configure(config):
    """The ranks' fork server imports the Hugging Face models the zoo builds (1.3 s a rank
    otherwise, and the suite starts ranks by the hundred: a pool per world size, a fresh one after
    every deliberate failure)."""
    from graphpass.runtime.launch import preload

    preload(*(f"transformers.models.{m}.modeling_{m}" for m in
              ("gpt2", "llama", "gpt_neox", "phi3", "t5", "mixtral", "qwen2_moe")))


@pytest.fixture(autouse=True)
def _reused_captures(request):
    """Tests capture the same zoo models again and again (Planner, gp.plan, capture, passes): the
    process captures each model class, configuration and batch shape once, as
    ``graphpass.reusing_captures`` promises for equal models (zoo models are fixed code and
    configs). test_capture.py tests capture itself (routes, failures, timing): it captures afresh."""
    if request.path.name == "test_capture.py":
        yield
        return
    import zoo
    from graphpass.capture import reusing_captures

    with reusing_captures(zoo.CAPTURES):  # the store zoo.compile and the ranks use: one per process
        yield


@pytest.fixture(scope="session")
def graphpass_rank_initializer():
    """Every compile on a pool's rank reuses the rank's captures, as in this process."""
    import zoo

    return zoo.reuse_captures_on_this_rank


@pytest.fixture(scope="session")
def rank_pool(graphpass_ranks):
    """``get(world_size) -> RankPool``: the graphpass pytest plugin's ``graphpass_ranks`` (one live
    pool per world size for the session; a failed or timed-out run restarts its ranks next time)."""
    return graphpass_ranks


# ======================================================================================
# END multi-rank pools
# ======================================================================================
