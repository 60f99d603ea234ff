"""The persistent CUDA LSTM prototype (benchmarks/persistent_cuda/): its plain-PyTorch
reference against torch.nn.LSTM in float64, its launch layout, the kernel source
compiled by NVRTC for sm_90 (skipped where cuda-python's NVRTC is not installed), and
the harness's checks and timing rows with the GPU parts replaced."""

import pytest
import torch
from benchmarks.persistent_cuda import prototype

import mirrorgrad.nn


@pytest.mark.parametrize(("hidden", "batch", "T"), [(8, 1, 1), (16, 3, 7), (24, 20, 5)])
def test_reference_matches_torch_lstm_in_float64(hidden, batch, T):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(hidden, hidden).double()
    x = torch.randn(T, batch, hidden, dtype=torch.float64)
    h0 = torch.randn(batch, hidden, dtype=torch.float64)
    c0 = torch.randn(batch, hidden, dtype=torch.float64)
    with torch.no_grad():
        y, (h_n, c_n) = lstm(x, (h0[None], c0[None]))
        ours = prototype.reference_forward(x, h0, c0, *prototype._weights(lstm))
    for got, want in zip(ours, (y, h_n[0], c_n[0])):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert prototype.relative_error(ours, (y, h_n[0], c_n[0])) < 1e-12


@pytest.mark.parametrize(("hidden", "sms"), [(96, 132), (512, 132), (520, 132), (1024, 132),
                                             (1024, 114), (8, 4), (4096, 132)])  # fmt: skip
def test_layout_covers_hidden_with_one_cta_per_sm_at_most(hidden, sms):
    layout = prototype.layout(hidden, sms)
    assert layout.units % 4 == 0 and layout.ctas <= sms
    assert layout.ctas * layout.units >= hidden > (layout.ctas - 1) * layout.units
    # the fewest units per CTA: four fewer would need more CTAs than SMs
    assert layout.units == 4 or -(-hidden // (layout.units - 4)) > sms


def test_layout_and_options_reject_what_the_kernel_does_not_take():
    with pytest.raises(ValueError, match="multiple of 8"):
        prototype.layout(100, 132)
    with pytest.raises(ValueError, match="dtype"):
        prototype.compile_options("fp16", 512, 4, 4, "sm_90")
    with pytest.raises(ValueError, match="variant"):
        prototype.compile_options("bf16", 512, 4, 4, "sm_90", "no-cell")


def _nvrtc_or_skip():
    try:
        nvrtc, _ = prototype._bindings()
        err, *_ = nvrtc.nvrtcVersion()  # loads libnvrtc
    except Exception as e:  # no cuda-python, or no libnvrtc for it to load
        pytest.skip(f"NVRTC through cuda-python is not available: {type(e).__name__}: {e}")
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(("hidden", "batch"), [(96, 1), (520, 3), (512, 4), (1024, 20)])
def test_kernel_compiles_for_sm90_without_warnings_or_spills(dtype, hidden, batch):
    _nvrtc_or_skip()
    layout = prototype.layout(hidden, 132)  # an H100's SMs
    for variant in prototype.VARIANTS:
        cubin, log = prototype.compile_cubin(dtype, hidden, batch, layout.units, "sm_90",
                                             variant)  # fmt: skip
        assert cubin[:4] == b"\x7fELF"
        assert "warning" not in log.lower(), (variant, log)
        assert "0 bytes spill stores, 0 bytes spill loads" in log, (variant, log)


def test_compile_error_carries_nvrtc_log(monkeypatch, tmp_path):
    _nvrtc_or_skip()
    broken = tmp_path / "broken.cu"
    broken.write_text('extern "C" __global__ void lstm_persistent_forward() { undeclared; }\n')
    monkeypatch.setattr(prototype, "SOURCE", broken)
    with pytest.raises(prototype.CompileError, match="undeclared"):
        prototype.compile_cubin("bf16", 512, 1, 4)


class _ReferenceKernel:
    """Stands in for PersistentLstm on the CPU: the reference's results, no launch."""

    def __init__(self, dtype, hidden, batch, device, variant=""):
        self.layout = prototype.layout(hidden, 132)
        self.registers, self.spill_bytes, self.compile_s = 128, 0, 0.0

    def forward(self, *args):
        return prototype.reference_forward(*args)

    def recurrence(self, *args):
        pass

    def timed_out(self):
        return False


class _PlainLstm(torch.nn.LSTM):
    """Stands in for mirrorgrad.nn.LSTM (whose persistent kernel the CPU would interpret)."""

    def __init__(self, *args, impl, **kwargs):
        super().__init__(*args, **kwargs)


class _Event:
    """Stands in for torch.cuda.Event: every span 1 ms."""

    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1.0


@pytest.mark.slow
def test_check_and_timing_rows_from_the_harness_on_cpu(monkeypatch, capsys):
    # The harness's own code (shapes, records, table) runs with the GPU parts replaced.
    monkeypatch.setattr(prototype, "PersistentLstm", _ReferenceKernel)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(mirrorgrad.nn, "LSTM", _PlainLstm)
    monkeypatch.setattr(prototype, "CHECK_HIDDEN", (16,))
    monkeypatch.setattr(prototype, "CHECK_BATCH", (3,))
    monkeypatch.setattr(prototype, "CHECK_T", (4,))
    cpu = torch.device("cpu")
    (case,) = prototype.run_checks(["bf16"], cpu)
    assert case["ok"] and 0 < case["error"] < case["tolerance"] and case["cudnn_error"] > 0
    row = prototype.time_case("fp32", 16, 2, 10, cpu)
    # 10 calls in 1 ms over 10 steps each: 10 us a step
    assert set(row["us_per_step"].values()) == {10.0} and not row["errors"]
    assert set(row["us_per_step"]) == {"cuda-kernel", "cuda-kernel-no-barrier",
                                       "cuda-kernel-no-product", "cuda-kernel-no-fences",
                                       "cuda-layer", "triton-persistent", "cudnn"}  # fmt: skip
    assert "| fp32 | 16 | 2 | 10.00 |" in prototype._table([row])


def test_a_failing_case_is_recorded_and_the_others_still_run(monkeypatch, capsys):
    monkeypatch.setattr(prototype, "CHECK_HIDDEN", (16, 24))
    monkeypatch.setattr(prototype, "CHECK_BATCH", (1,))
    monkeypatch.setattr(prototype, "CHECK_T", (1,))

    def check_case(dtype, hidden, batch, T, device):
        if hidden == 16:
            raise RuntimeError("CUDA driver: CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE")
        return {"ok": True, "error": 0.0, "no_fences_error": 0.0, "cudnn_error": 0.0,
                "tolerance": 1.0}  # fmt: skip

    monkeypatch.setattr(prototype, "check_case", check_case)
    failed, passed = prototype.run_checks(["fp32"], torch.device("cpu"))
    assert not failed["ok"] and "TOO_LARGE" in failed["exception"] and passed["ok"]
    assert "check fp32 H=16 B=1 T=1: RuntimeError" in capsys.readouterr().out
