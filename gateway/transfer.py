"""Bytes a burst node moved through the tunnel, measured at the gateway (issue 27 part 1).

Every byte between a burst node and home passes the gateway's WireGuard interface. wireguard-go counts per peer
(UAPI ``get=1``): ``rx_bytes``, what the gateway received from the node, i.e. **node -> home**: the data that
LEAVES the remote cloud, what the cloud charges egress for; ``tx_bytes``, what the gateway sent the node, i.e.
**home -> node** (ingress for the remote cloud, usually free). Both count the encrypted UDP payload (WireGuard's
16-byte header + the padded inner IP packet + the 16-byte Poly1305 tag), not the outer IP/UDP headers.

Those counters live in the wireguard-go process: a gateway restart (a new interface) or a peer removed and
re-added starts them at 0. So the gateway keeps, per node in its slot record, the accumulated totals and the last
raw counters it saw; ``accumulate`` adds what the raw counters moved since. A raw counter lower than the last seen
is a reset (everything it shows is new), unless the last seen was within ``WRAP_WINDOW`` of 2**64, a wrap of the
unsigned 64-bit counter."""

from __future__ import annotations

import json
from dataclasses import asdict
from dataclasses import dataclass
from typing import Final

COUNTER_LIMIT: Final = 2**64  # wireguard-go's counters are uint64
# A lower raw value after a last one this close to 2**64 is a wrap, not a reset (no peer moves 2**32 bytes in one
# pass, and no reset leaves the last value this high).
WRAP_WINDOW: Final = 2**32


@dataclass(frozen=True)
class Transfer:
    """A node's tunnel traffic as the gateway accounted it: totals since its peer was first added (``rx``:
    node -> home, ``tx``: home -> node), the raw counters of the last reading, and when that was (epoch s)."""

    rx_bytes: int = 0
    tx_bytes: int = 0
    last_rx: int = 0
    last_tx: int = 0
    measured_at: float = 0.0

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> Transfer:
        """From a slot record's ``transfer`` value; an absent or unreadable one is no traffic yet."""
        if not text:
            return cls()
        try:
            doc = json.loads(text)
            return cls(rx_bytes=int(doc.get("rx_bytes", 0)), tx_bytes=int(doc.get("tx_bytes", 0)),
                       last_rx=int(doc.get("last_rx", 0)), last_tx=int(doc.get("last_tx", 0)),
                       measured_at=float(doc.get("measured_at", 0.0)))
        except (ValueError, TypeError, AttributeError):
            return cls()


def _moved(last: int, raw: int) -> int:
    if raw >= last:
        return raw - last
    if last >= COUNTER_LIMIT - WRAP_WINDOW:
        return raw + COUNTER_LIMIT - last  # wrapped
    return raw  # reset: a restarted interface, or the peer re-added: all it shows is new


def accumulate(previous: Transfer, raw_rx: int, raw_tx: int, now: float) -> Transfer:
    """``previous`` plus what the raw counters (of the peer now) moved since its last reading."""
    if raw_rx < 0 or raw_tx < 0:
        raise ValueError(f"negative WireGuard counters rx={raw_rx} tx={raw_tx}")
    return Transfer(rx_bytes=previous.rx_bytes + _moved(previous.last_rx, raw_rx),
                    tx_bytes=previous.tx_bytes + _moved(previous.last_tx, raw_tx),
                    last_rx=raw_rx, last_tx=raw_tx, measured_at=now)


def restarted(previous: Transfer) -> Transfer:
    """The record of a peer whose counters start at 0 again (the interface was restarted, or the peer re-added
    after its record was last written): the totals stay, the next raw reading counts from 0."""
    return Transfer(rx_bytes=previous.rx_bytes, tx_bytes=previous.tx_bytes, measured_at=previous.measured_at)
