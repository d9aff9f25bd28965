"""`engine.state_report()`: where every state lives and how many bytes it holds there."""

from __future__ import annotations


class StateReport(dict):
    """state name -> {where: bytes}: where each state is now. `where` is a device ("cpu", "cuda:0")
    or "nvme" (on disk). `homes` has the same shape: where each state's tier keeps it (the device,
    the host with ZeRO-Offload, disk with ZeRO-Infinity), to which `reload_states()` brings it back.

    A dict, so code can read it; `str()` is a table, so `print(engine.state_report())` reads well.
    A freed scratch bucket (or a state the engine does not have) maps to {}.
    """

    def __init__(
        self, entries: dict[str, dict[str, int]], homes: dict[str, dict[str, int]], disk_directory: str | None,
        pinned_bytes: int,
    ) -> None:
        super().__init__(entries)
        self.homes = homes
        self.disk_directory = disk_directory
        self.pinned_bytes = pinned_bytes

    def bytes_on(self, where: str) -> int:
        """Total bytes of every state held at `where` ("cpu", "cuda:0", "nvme")."""
        return sum(places.get(where, 0) for places in self.values())

    def __str__(self) -> str:
        rows = [("state", "home", "now", "bytes", "MiB")]
        for state, places in self.items():
            home = ",".join(self.homes.get(state, {})) or "-"
            if not places:
                rows.append((state, home, "(freed)" if state == "contiguous_grad_buffer" else "(none)", "0", "0.0"))
            for where, nbytes in places.items():
                rows.append((state, home, where, str(nbytes), f"{nbytes / 2**20:.1f}"))
        places = sorted({where for p in self.values() for where in p})
        for where in places:
            total = self.bytes_on(where)
            rows.append(("total", "", where, str(total), f"{total / 2**20:.1f}"))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = []
        for index, row in enumerate(rows):
            cells = [row[i].ljust(widths[i]) for i in range(3)] + [row[i].rjust(widths[i]) for i in (3, 4)]
            lines.append("  ".join(cells))
            if index == 0:
                lines.append("  ".join("-" * w for w in widths))
        if self.disk_directory:
            lines.append(f"disk: {self.disk_directory}")
        if self.pinned_bytes:
            lines.append(f"pinned host buffers kept for reuse: {self.pinned_bytes / 2**20:.1f} MiB")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"StateReport({dict.__repr__(self)})"
