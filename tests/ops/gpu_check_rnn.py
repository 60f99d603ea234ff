"""One GPU call for the RNN op: the LM-step table and the op's memory table.

    python tests/ops/gpu_check_rnn.py OUT_DIR

Runs ``gpu_lm_step.py`` (PyTorch example eager, mirrorgrad eager, torch.compile, + CUDA
Graphs, mirrorgrad.compile balance, + CUDA Graphs: cold s, ms, tok/s, peak) and
``gpu_rnn_memory.py`` (the op's stash/recompute peaks, graph cache) as subprocesses, each
under its own time limit, going on past a part that fails; prints both tables last.
Writes their JSON and OUT_DIR/<part>.log.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
# (name, script, extra arguments, seconds): under 6 minutes together on an H100.
LM_ARGS = ["--preset", "medium", "--batch", "20", "--budget-s", "200"]
PARTS = [
    ("lm_step", "gpu_lm_step.py", LM_ARGS, 230),
    ("rnn_memory", "gpu_rnn_memory.py", [], 120),
]
TAIL_LINES = 40


def run_part(out_dir: Path, name: str, script: str, args: list[str], limit: int) -> str:
    """The part's last lines of output (its tables), or why it has none."""
    command = [sys.executable, str(HERE / script), str(out_dir), *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        (out_dir / f"{name}.log").write_text(text)
        return f"{name}: stopped after {limit} s\n" + "\n".join(text.splitlines()[-TAIL_LINES:])
    (out_dir / f"{name}.log").write_text(done.stdout + done.stderr)
    lines = (done.stdout if done.returncode == 0 else done.stdout + done.stderr).splitlines()
    status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
    return f"{name}: {status}\n" + "\n".join(lines[-TAIL_LINES:])


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = [run_part(out, *part) for part in PARTS]
    print("\n\n".join(tables))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
