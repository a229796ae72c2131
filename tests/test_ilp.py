"""The ILP front end (graphpass.cost.solver.ilp): one model, every backend, a deadline."""

import math
import threading
import time

import pytest

from graphpass.cost.solver import ilp

BACKENDS = [ilp.HIGHS, ilp.SCIP, ilp.CP_SAT]


def small_mip(model: ilp.Model):
    """min c - 2a - 3b s.t. a + 2b <= 4, a - c <= 1: optimum -6 at a = 2, b = 1, c = 1."""
    a = model.int_var(0, 3, "a")
    b = model.bool_var("b")
    # CP-SAT has no continuous variables; c is integral at the optimum anyway.
    c = model.int_var(0, 100, "c") if model.integral else model.num_var(0.0, math.inf, "c")
    model.add_linear([a, b], [1, 2], -math.inf, 4)
    model.add_linear([a, c], [1, -1], -math.inf, 1)
    model.minimize([c, a, b], [1, -2, -3])
    return a, b, c


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_model_reaches_the_same_optimum_on_every_backend(backend):
    result, (a, b, c) = ilp.solve(small_mip, backend, math.inf)
    assert result.status == ilp.OPTIMAL and result.found
    assert result.objective == pytest.approx(-6)
    assert [round(result.value(v)) for v in (a, b, c)] == [2, 1, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_variable_repeated_in_a_row_counts_twice(backend):
    def build(model):
        x = model.bool_var("x")
        model.add_linear([x, x], [1, 1], -math.inf, 1)
        model.minimize([x], [-1])
        return x

    result, x = ilp.solve(build, backend, math.inf)
    assert result.status == ilp.OPTIMAL and result.value(x) == pytest.approx(0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_without_a_solution_is_proven_infeasible(backend):
    def build(model):
        xs = [model.bool_var("x"), model.bool_var("y")]
        model.add_linear(xs, [1, 1], 3, math.inf)
        model.minimize(xs, [1, 1])

    result, _ = ilp.solve(build, backend, math.inf)
    assert result.status == ilp.INFEASIBLE and not result.found


def test_a_solve_past_its_deadline_is_abandoned_without_an_answer(monkeypatch):
    monkeypatch.setattr(ilp, "_DEADLINE_GRACE_S", 0.05)

    release, built = threading.Event(), threading.Event()

    def slow(model):
        release.wait(60)  # still building when the deadline and its grace have passed
        built.set()
        return small_mip(model)

    result, handles = ilp.solve(slow, ilp.HIGHS, time.perf_counter() + 0.01, warn=False)
    # solve came back while the build was still waiting: it did not wait for the build
    assert result.status == ilp.UNKNOWN and handles is None and not built.is_set()
    release.set()


def test_an_error_while_building_reaches_the_caller():
    with pytest.raises(TypeError, match="no continuous variables"):
        ilp.solve(lambda model: model.num_var(0.0, 1.0, "c"), ilp.CP_SAT, math.inf)


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="'gurobi'"):
        ilp.solve(small_mip, "gurobi", math.inf)


def test_highs_writes_nothing_to_stdout_and_gives_it_back(capfd):
    ilp.solve(small_mip, ilp.HIGHS, math.inf)
    print("after the solve")
    assert capfd.readouterr().out == "after the solve\n"
