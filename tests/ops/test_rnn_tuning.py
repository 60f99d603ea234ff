"""The Triton kernels' knobs (ops/rnn/tuning.py): what the launching code reads, set for a
block or passed explicitly, and the benchmark's knob sets in terms of them."""

from dataclasses import replace

import pytest
import torch

from mirrorgrad.ops.rnn import persistent_plan, persistent_probes, step_loop
from mirrorgrad.ops.rnn.tuning import PersistentTuning, StepTuning, active, tuned

CUDA = torch.device("cuda")


@pytest.fixture
def h100_grid(monkeypatch):
    """plan() as on a GPU with 132 SMs (no GPU needed: it only sizes the grid)."""
    monkeypatch.setattr(step_loop, "interpreting", lambda: False)
    monkeypatch.setattr(persistent_plan, "_programs_at_once", lambda device: 132)


def test_tuned_sets_the_active_knobs_for_the_block_only():
    default = active(StepTuning)
    assert step_loop.chunk_steps(100, 64) == 100  # 6400 rows: one chunk at 8192
    with tuned(StepTuning(bwd_chunk_rows=640)) as knobs:
        assert active(StepTuning) is knobs
        assert step_loop.chunk_steps(100, 64) == 10
        assert step_loop.default_fused(1) is False
        with tuned(replace(knobs, fused_max_batch=4)):
            assert step_loop.default_fused(4) and not step_loop.default_fused(5)
        assert active(StepTuning) is knobs
    assert active(StepTuning) is default


def test_tuned_restores_after_an_error_and_rejects_other_objects():
    default = active(PersistentTuning)
    with pytest.raises(RuntimeError, match="inside"), tuned(PersistentTuning(block_n=32)):
        raise RuntimeError("inside")
    assert active(PersistentTuning) is default
    with pytest.raises(TypeError, match="StepTuning or PersistentTuning"):
        tuned({"block_n": 32}).__enter__()


def test_plan_reads_the_active_or_the_given_knobs(h100_grid):
    wide = ("lstm", 4, 8448, torch.bfloat16, CUDA)  # 132 programs of 64 units
    assert persistent_plan.plan(*wide).bn == 64
    narrower = PersistentTuning(max_bn=32)
    assert persistent_plan.plan(*wide, tuning=narrower) is None
    with tuned(narrower):
        assert persistent_plan.plan(*wide) is None
    assert persistent_plan.plan(*wide) is not None
    small = ("lstm", 20, 650, torch.float32, CUDA)  # 192 KiB of W_hh per program
    assert not persistent_plan.plan(*small).resident
    assert persistent_plan.plan(*small, tuning=PersistentTuning(resident_bytes=1 << 20)).resident
    knobs = PersistentTuning(split_k=4, bwd_split_k=2, spin_load=True, gather_loads=False)
    layout = persistent_plan.plan(*small, tuning=replace(knobs, resident_bytes=0))
    assert (layout.split, layout.bwd_split, layout.spin_load, layout.gather) == (4, 2, True, False)


def test_probes_record_inside_the_block_only():
    assert persistent_probes.PROBES is None
    with persistent_probes.recording(level=3) as stamps:
        assert persistent_probes.PROBES is stamps and persistent_probes.PROBE_LEVEL == 3
    assert persistent_probes.PROBES is None and persistent_probes.PROBE_LEVEL == 1
    with pytest.raises(ValueError, match="probe level"), persistent_probes.recording(level=4):
        pass


def test_bench_knob_sets_are_tuning_fields():
    from benchmarks.persistent_rnn import SWEEP, VARIANTS, knobs_applied

    for knobs in (*VARIANTS.values(), *SWEEP):
        assert isinstance(knobs_applied(knobs), PersistentTuning)
    # A JSON file's lists come back as tuples: the plans are cached by their knobs.
    assert knobs_applied({"resident_warps": [8, 8]}).resident_warps == (8, 8)
    with pytest.raises(ValueError, match="no knob"):
        knobs_applied({"BLOCK_N": 32})
