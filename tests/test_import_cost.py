"""What `import zero3` loads: every process that imports zero3 pays it (each torchrun worker, each
checkpoint writer, a generator's weight receiver), so heavy modules a process may never use load where
they are used instead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.distributed import script_env

REPO = Path(__file__).resolve().parents[1]

# torch.distributed.checkpoint brings DTensor and sympy: about a second of a 2.4 s import here.
LOADED_ON_USE = ["torch.distributed.checkpoint", "torch.distributed.tensor", "sympy"]


def loaded_after(code: str) -> list[str]:
    probe = f"import json, sys\n{code}\nprint(json.dumps([m for m in {LOADED_ON_USE!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env=script_env(str(REPO)), cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_zero3_leaves_dcp_to_the_first_save_or_load() -> None:
    assert loaded_after("import zero3") == []
    # ...and a save or load still finds it: the module that runs them imports it.
    assert "torch.distributed.checkpoint" in loaded_after("import zero3.checkpoint.state")
