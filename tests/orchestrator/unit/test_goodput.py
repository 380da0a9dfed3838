"""The goodput ledger: its parts partition the wall time, whatever order and overlap the
intervals come in."""

import pytest

from orchestrator.telemetry.goodput import BADPUT, USEFUL, Ledger


def parts(breakdown):
    return breakdown["useful_seconds"] + sum(breakdown["badput_seconds"].values())


def test_intervals_and_the_gaps_between_them_add_up_to_the_wall_time():
    ledger = Ledger(100.0)
    ledger.add("planning", 100.0, 101.0)
    ledger.gap = "startup"  # a group forms: uncovered time until its first report is startup
    ledger.add("compile", 104.0, 106.0)
    ledger.add(USEFUL, 106.0, 107.5)
    b = ledger.breakdown(110.0)
    assert b["wall_seconds"] == 10.0 and parts(b) == pytest.approx(10.0)
    assert b["badput_seconds"]["startup"] == pytest.approx(3.0 + 2.5)  # 101-104, and the tail 107.5-110
    assert b["goodput_ratio"] == pytest.approx(0.15)


def test_an_interval_that_overlaps_what_is_charged_is_clipped():
    ledger = Ledger(0.0)
    ledger.add(USEFUL, 0.0, 2.0)
    ledger.add("checkpoint", 1.5, 3.0)  # another host's clock is half a second behind
    b = ledger.breakdown(3.0)
    assert b["useful_seconds"] == 2.0 and b["badput_seconds"]["checkpoint"] == 1.0 and parts(b) == 3.0


def test_a_breakdown_mid_run_does_not_move_the_ledger():
    ledger = Ledger(0.0)
    ledger.add(USEFUL, 0.0, 1.0)
    assert ledger.breakdown(5.0)["badput_seconds"]["startup"] == 4.0
    ledger.gap = "lost"
    ledger.fill(6.0)
    assert ledger.breakdown(6.0)["badput_seconds"] == {**dict.fromkeys(BADPUT, 0.0), "lost": 5.0}


def test_an_unknown_category_is_an_error_that_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown goodput category 'waiting'"):
        Ledger(0.0).add("waiting", 0.0, 1.0)
