"""Regression tests of users' own models in their CI: graphpass's own test harness, for users.

    from graphpass.testing import assert_parity

    def test_my_model_trains_the_same(graphpass_ranks):
        assert_parity(build_model, make_batches, [gp.Strategy(), gp.Strategy(zero=3)],
                      ranks=graphpass_ranks, golden_dir=Path(__file__).parent / "golden")

* :func:`assert_parity` (``parity.py``): every strategy on local ranks against one process.
* :func:`assert_golden` / :func:`program_text` (``golden.py``): the plan and collective sequence
  against a file under review.
* the pytest plugin (``plugin.py``): the ``graphpass_ranks`` fixture and ``--graphpass-update-golden``.
"""

from graphpass.testing.golden import GoldenMismatch, assert_golden, program_text
from graphpass.testing.parity import ParityError, ParityResult, assert_parity, full_grads, train_reference

__all__ = ["GoldenMismatch", "ParityError", "ParityResult", "assert_golden", "assert_parity", "full_grads",
           "program_text", "train_reference"]
