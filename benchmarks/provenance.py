"""Where and when a benchmark ran: the date, the command and the machine, written into its JSON.

`benchmarks/figures.py` prints them beside every figure it takes from that JSON.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any


def machine() -> str:
    """The machine in words: its GPU where torch sees one, else its processor, and its core count."""
    import torch  # here, not at import: recovery.py times its own imports

    cores = f"{os.cpu_count()} cores"
    if torch.cuda.is_available():
        return f"one {torch.cuda.get_device_name(0)}, {cores}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # bf16 figures on a CPU without bf16 units measure emulation (about 170x an fp32 matmul): say which.
    from zero3.accelerator import cpu_capability

    return f"{model} ({cpu_capability()}), {cores}, no GPU"


def provenance() -> dict[str, Any]:
    import torch

    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(Path(__file__).resolve().parents[1])
    except ValueError:
        pass
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", str(script), *sys.argv[1:]]),
            "machine": machine(), "torch": torch.__version__}


def write_run(path: Path, benchmark: str, args: Any, **figures: Any) -> None:
    """A run's JSON at `path`: the benchmark's name, its provenance, its arguments (`setup`) and `figures`."""
    setup = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    out = {"benchmark": benchmark, "provenance": provenance(), "setup": setup, **figures}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"measured on {out['provenance']['machine']}")
    print(f"wrote {path}")
