"""RestartBudget: restarts allowed over a sliding window, never a lifetime count."""

from __future__ import annotations

from common.restart_budget import RestartBudget


def test_exits_inside_the_window_exhaust_the_budget():
    budget = RestartBudget(max_restarts=2, window_seconds=60.0)
    assert [budget.allow(t) for t in (0.0, 10.0, 20.0)] == [True, True, False]
    assert budget.recent_exits == 3


def test_the_window_slides_so_old_exits_stop_counting():
    budget = RestartBudget(max_restarts=2, window_seconds=60.0)
    assert budget.allow(0.0) and budget.allow(50.0)
    assert budget.allow(65.0)  # the exit at 0 s left the window
    assert budget.recent_exits == 2
    # A process that fails now and then forever is always restarted.
    assert all(budget.allow(200.0 + 61.0 * i) for i in range(50))


def test_zero_restarts_gives_up_at_the_first_exit():
    assert not RestartBudget(max_restarts=0, window_seconds=1.0).allow(0.0)
