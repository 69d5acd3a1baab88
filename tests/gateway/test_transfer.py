"""The accounting of a node's tunnel counters (gateway.transfer): what the raw WireGuard counters moved is added
to the totals across resets (a restarted interface, a peer re-added), a wrap of the 64-bit counters, and the
record round-trips through its ConfigMap value."""

from __future__ import annotations

import pytest

from gateway.transfer import COUNTER_LIMIT
from gateway.transfer import Transfer
from gateway.transfer import accumulate
from gateway.transfer import restarted


def test_counters_that_climb_add_what_they_moved() -> None:
    t = accumulate(Transfer(), 1000, 200, now=1.0)
    assert (t.rx_bytes, t.tx_bytes, t.last_rx, t.last_tx, t.measured_at) == (1000, 200, 1000, 200, 1.0)
    t = accumulate(t, 1500, 200, now=2.0)
    assert (t.rx_bytes, t.tx_bytes) == (1500, 200)
    assert accumulate(t, 1500, 200, now=3.0).rx_bytes == 1500  # nothing moved: nothing added


def test_a_reset_counts_everything_the_new_counters_show() -> None:
    # 10 000 accounted, the interface restarted, the new one counted 300 / 40 since: nothing lost, nothing twice.
    t = accumulate(Transfer(), 10_000, 5_000, now=1.0)
    after = accumulate(t, 300, 40, now=2.0)
    assert (after.rx_bytes, after.tx_bytes) == (10_300, 5_040)
    assert (after.last_rx, after.last_tx) == (300, 40)
    # Each direction on its own: rx reset, tx climbed.
    mixed = accumulate(t, 100, 6_000, now=2.0)
    assert (mixed.rx_bytes, mixed.tx_bytes) == (10_100, 6_000)


def test_a_peer_re_added_counts_from_zero_even_past_its_old_value() -> None:
    # A raw value above the last one cannot tell a reset that climbed past it: the gateway marks a peer it just
    # added (restarted) so its counters count from 0.
    t = accumulate(Transfer(), 1_000, 100, now=1.0)
    again = accumulate(restarted(t), 5_000, 700, now=2.0)
    assert (again.rx_bytes, again.tx_bytes) == (6_000, 800)
    assert restarted(t).measured_at == 1.0 and (restarted(t).last_rx, restarted(t).last_tx) == (0, 0)
    wrong = accumulate(t, 5_000, 700, now=2.0)  # without the mark, 1 000 / 100 would be lost
    assert (wrong.rx_bytes, wrong.tx_bytes) == (5_000, 700)


def test_a_wrap_of_the_64_bit_counter_adds_what_crossed_it() -> None:
    t = Transfer(rx_bytes=7, tx_bytes=0, last_rx=COUNTER_LIMIT - 10, last_tx=0)
    after = accumulate(t, 5, 0, now=1.0)
    assert after.rx_bytes == 7 + 10 + 5
    # Far from the top a lower value is a reset, not a wrap.
    assert accumulate(Transfer(rx_bytes=7, last_rx=2**40), 5, 0, now=1.0).rx_bytes == 12


def test_negative_counters_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        accumulate(Transfer(), -1, 0, now=0.0)


def test_the_record_round_trips_and_an_unreadable_one_is_no_traffic() -> None:
    t = Transfer(rx_bytes=2**63, tx_bytes=3, last_rx=4, last_tx=5, measured_at=6.5)
    assert Transfer.loads(t.dumps()) == t
    assert Transfer.loads("") == Transfer() == Transfer.loads("{not json") == Transfer.loads("[1]")
