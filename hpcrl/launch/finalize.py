"""Close the books of a finished run, so every admitted prompt group has an outcome.

Called by the supervisor after the trainer wrote ``DONE`` and the rollouts
stopped. Groups still waiting in the spool and tickets still being generated
when the run ended are recorded as dropped, with the reason, in the
admission ledger (a waiting file whose ticket was never admitted, or is
trained already, is quarantined instead: it changes no ticket); then ``jobs/finalized.json`` is
written. From then on the
audit requires every admitted ticket to be trained exactly once or dropped.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from hpcrl.fs import atomic
from hpcrl.admission.config import AdmissionConfig
from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.runtime.owner import Fence
from hpcrl.spool.store import Spool

log = logging.getLogger(__name__)


def finalize(run_dir: Path, fence: Fence | None = None) -> dict[str, int]:
    spool = Spool(run_dir / "spool", fence)
    ledger = AdmissionLedger(run_dir / "admission", AdmissionConfig(), num_rows=1, fence=fence)
    waiting = spool.ready() + spool.claimed()
    trained = {e.ticket for entries in spool.trained().values() for e in entries}
    for entry in waiting:
        if not ledger.admitted(entry.ticket) or entry.ticket in trained:
            spool.quarantine(entry, f"ticket {entry.ticket} was never admitted" if entry.ticket not in trained
                             else f"ticket {entry.ticket} is trained already (a duplicate)")
            continue
        spool.drop(entry, "run ended before it was trained")
        ledger.record_drop(entry.ticket, "run ended before it was trained")
    spool.sync()
    dropped = set(ledger.dropped())
    in_flight = [n for n in ledger.holders() if n not in trained and n not in dropped]
    for n in in_flight:
        ledger.record_drop(n, "run ended while it was being generated")
    counts = {"waiting_dropped": len(waiting), "in_flight_dropped": len(in_flight), "trained": len(trained)}
    atomic.write_json(run_dir / "jobs" / "finalized.json", {**counts, "time": time.time()})
    log.info("run closed: %s", counts)
    return counts
