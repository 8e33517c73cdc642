"""The communication ledger: count and bytes of every attention collective and P2P, per layer.

Communication code records (layer, pass, op, axis, bytes) here; the trainer prints the table at
--timing-log-level 2 and clears it. Bytes are this rank's outgoing message: for an all-to-all the
whole local input (what the Ulysses paper calls the per-link volume M/P), for a P2P the tensor sent.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

Key = Tuple[int, str, str, str]  # (layer, "fwd"|"bwd", op, axis)


@dataclass
class Entry:
    count: int = 0
    bytes: int = 0


class CommLedger:
    def __init__(self):
        self.entries: Dict[Key, Entry] = defaultdict(Entry)
        self.layer: Optional[int] = None
        self.enabled = True

    @contextlib.contextmanager
    def scope(self, layer: int):
        """Attribute the communication issued inside the block to `layer`."""
        previous, self.layer = self.layer, layer
        try:
            yield
        finally:
            self.layer = previous

    def record(self, layer: Optional[int], phase: str, op: str, axis: str, nbytes: int) -> None:
        if not self.enabled:
            return
        entry = self.entries[(-1 if layer is None else layer, phase, op, axis)]
        entry.count += 1
        entry.bytes += int(nbytes)

    def clear(self) -> None:
        self.entries.clear()

    def totals(self, layer: Optional[int] = None) -> Dict[Tuple[str, str, str], Entry]:
        """(phase, op, axis) -> Entry, for one layer or summed over all."""
        out: Dict[Tuple[str, str, str], Entry] = defaultdict(Entry)
        for (lay, phase, op, axis), e in self.entries.items():
            if layer is None or lay == layer:
                out[(phase, op, axis)].count += e.count
                out[(phase, op, axis)].bytes += e.bytes
        return dict(out)

    def format(self, iterations: int = 1) -> str:
        """Per layer, per (pass, op, axis): count and MB per iteration."""
        if not self.entries:
            return "communication ledger: no attention communication"
        lines = ["communication ledger (per iteration, this rank):",
                 f"    {'layer':>5} {'pass':>4} {'op':>10} {'axis':>6} {'count':>7} {'MB':>10}"]
        for (layer, phase, op, axis), e in sorted(self.entries.items()):
            lines.append(f"    {layer:>5} {phase:>4} {op:>10} {axis:>6} {e.count / iterations:>7.1f} "
                         f"{e.bytes / iterations / 2**20:>10.3f}")
        return "\n".join(lines)


LEDGER = CommLedger()
