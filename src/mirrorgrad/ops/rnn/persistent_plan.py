"""How the persistent kernel lays out one layer's launch (``plan``): hidden units per
program, batch tiles and groups, W_hh resident or streamed, and the tuning knobs the
kernels compile with (``PersistentTuning``); None where the layer runs kernels.py's."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from mirrorgrad.ops.rnn import kernels, step_loop
from mirrorgrad.ops.rnn.cell_modes import GATES, MODES
from mirrorgrad.ops.rnn.tuning import PersistentTuning, active


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    """How one layer's launch is laid out."""

    programs: int  # blocks of hidden units (grid axis 0)
    groups: int  # groups of batch tiles (grid axis 1); programs * groups <= SMs
    bn: int  # hidden units per program (all G gates of them)
    bb: int  # batch rows per tile (a program loops over its group's tiles)
    ka: int  # resident W: K split into two power-of-two pieces ka + kb >= H
    kb: int
    bk: int  # streamed W: K chunk per load
    resident: bool  # W_hh slice kept in registers across steps (else streamed from L2)
    num_warps: int  # forward
    bwd_warps: int
    num_stages: int  # software pipelining of the streamed K loop
    spin_load: bool  # barrier polls with loads (else with atomics)
    fuse_gates: bool  # forward: one dot for all gates (lstm, gru)
    split: int  # streamed K chunks in this many slices (independent MMA chains)
    bwd_bk: int
    bwd_split: int
    rsplit: int  # resident: K slices of the forward (fused gates) and
    bwd_rsplit: int  # the backward
    gather: bool  # backward: each step's other inputs in one load per dtype
    part_bytes: int  # resident backward: shared memory for W and a part's dG rows
    spill_words: int  # a resident layout that spills more runs streamed,
    allow_spills: bool  # unless this
    streamed_bb: int  # bb, groups and (forward, backward) warps of the streamed
    streamed_groups: int  # fallback of a resident plan
    streamed_warps: tuple[int, int]

    def streamed(self) -> Plan:
        """This layout with W streamed (where the resident one does not fit)."""
        if not self.resident:
            return self
        fwd_warps, bwd_warps = self.streamed_warps
        return replace(self, resident=False, bb=self.streamed_bb, groups=self.streamed_groups,
                       num_warps=fwd_warps, bwd_warps=bwd_warps)  # fmt: skip

    def w_bytes(self, mode: str, dtype: torch.dtype) -> int:
        """W_hh bytes one program holds when resident."""
        return GATES[mode] * self.bn * (self.ka + self.kb) * dtype.itemsize


def k_pieces(H: int) -> tuple[int, int]:
    """(ka, kb): powers of two (>= 16, kb may be 0) with ka + kb >= H and little padding."""
    ka = max(16, 1 << (H.bit_length() - 1))
    rest = H - ka
    return ka, (0 if rest <= 0 else max(16, triton.next_power_of_2(rest)))


@functools.cache
def _programs_at_once(device: torch.device) -> int:
    """Programs that are surely resident together: one per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(mode: str, B: int, H: int, dtype: torch.dtype, device: torch.device,
         tuning: PersistentTuning | None = None) -> Plan | None:  # fmt: skip
    """The launch layout of a layer with ``tuning``'s knobs (None: the active ones), or
    None where the persistent kernel does not run it (kernels.py does): an empty batch,
    or a grid beyond the SMs even at ``tuning.max_bn`` units per program."""
    if B == 0 or mode not in MODES:
        return None
    interpreting = step_loop.interpreting()
    if not interpreting and device.type != "cuda":
        return None
    sms = 0 if interpreting else _programs_at_once(device)
    return _plan(mode, B, H, dtype, interpreting, sms, tuning or active(PersistentTuning))


# Cached: a layer call asks twice per step of training, and building the frozen Plans
# costs host time that a launch-bound step pays in full.
@functools.lru_cache(maxsize=256)
def _plan(mode: str, B: int, H: int, dtype: torch.dtype, interpreting: bool, sms: int,
          tuning: PersistentTuning) -> Plan | None:  # fmt: skip
    """``plan`` for a non-empty batch on ``sms`` SMs (0: the interpreter's layout)."""
    ka, kb = k_pieces(H)
    knobs = dict(spin_load=tuning.spin_load, fuse_gates=tuning.fuse_gates,
                 bwd_bk=tuning.bwd_block_k, bwd_split=tuning.bwd_split_k,
                 rsplit=tuning.resident_split, bwd_rsplit=tuning.bwd_resident_split,
                 gather=tuning.gather_loads, part_bytes=tuning.bwd_part_bytes,
                 spill_words=tuning.spill_words, allow_spills=tuning.allow_spills,
                 streamed_warps=(tuning.num_warps, tuning.bwd_num_warps))  # fmt: skip
    if interpreting:  # programs run in turn: one program owns every unit
        bn = max(16, triton.next_power_of_2(H))
        return Plan(programs=1, groups=1, bn=bn, bb=16, ka=ka, kb=kb, bk=16, resident=True,
                    num_warps=4, bwd_warps=4, num_stages=1, split=1, streamed_bb=16,
                    streamed_groups=1, **knobs)  # fmt: skip
    bn = tuning.block_n
    while triton.cdiv(H, bn) > sms:
        bn *= 2
    if bn > tuning.max_bn:
        return None
    programs = triton.cdiv(H, bn)
    bb, groups = _batch_tiles(B, sms // programs, tuning.max_bb)
    streamed = Plan(programs=programs, groups=groups, bn=bn, ka=ka, kb=kb, bk=tuning.block_k,
                    bb=bb, resident=False, num_warps=tuning.num_warps,
                    bwd_warps=tuning.bwd_num_warps, num_stages=tuning.num_stages,
                    split=tuning.split_k, streamed_bb=16, streamed_groups=1,
                    **knobs)  # fmt: skip
    if streamed.w_bytes(mode, dtype) > tuning.resident_bytes:
        return streamed
    fwd_warps, bwd_warps = tuning.resident_warps
    return replace(streamed, bb=16, groups=_batch_tiles(B, sms // programs, 16)[1],
                   resident=True, num_warps=fwd_warps, bwd_warps=bwd_warps, streamed_bb=bb,
                   streamed_groups=streamed.groups)  # fmt: skip


def _batch_tiles(B: int, max_groups: int, max_bb: int) -> tuple[int, int]:
    """(rows per tile, groups): the smallest tile (>= 16 rows, <= max_bb) that gives every
    group one tile within max_groups groups; tiles beyond that are looped over."""
    bb = 16
    while bb < max_bb and triton.cdiv(B, bb) > max_groups:
        bb *= 2
    return bb, max(1, min(max_groups, triton.cdiv(B, bb)))


def supports_persistent(
    mode: str, *, proj: bool, dtype: torch.dtype, device: torch.device | str, hidden: int,
    batch: int,
) -> bool:  # fmt: skip
    """Whether persistent.py's ``layer_forward`` / ``layer_backward`` run the persistent
    kernel for this layer (else they run kernels.py's): the cases ``kernels.supports``
    takes, a non-empty batch, and a hidden size whose grid fits the SMs (at most
    ``PersistentTuning.max_bn`` units per program: on an H100's 132 SMs, H <= 8448)."""
    device = torch.device(device)
    return kernels.supports(mode, proj=proj, dtype=dtype, device=device) and (
        plan(mode, batch, hidden, dtype, device) is not None
    )


def formula_plan(mode: str, B: int, H: int, dtype: torch.dtype, device: torch.device):
    """``plan`` where the op's formulas ask; None (kernels.py's layers) also where no GPU
    is here to size the grid by."""
    try:
        return plan(mode, B, H, dtype, device)
    except (AssertionError, RuntimeError):  # torch.cuda without a device
        return None

