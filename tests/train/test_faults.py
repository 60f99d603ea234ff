"""Fault injection for `mirrorgrad train lm`: damaged checkpoints, unwritable folders,
bad numbers, divergence, signals and kill -9. Every failure is one line and a
non-zero exit before any training, never a traceback, and never a lost checkpoint."""

import errno
import hashlib
import io
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.child import TIMEOUT_S, read_line

import mirrorgrad
from mirrorgrad.cli import main
from mirrorgrad.options import MirrorOptions
from mirrorgrad.train import checkpoint, data, evaluation, loop, preflight, probes
from mirrorgrad.train.config import TrainConfig
from mirrorgrad.train.loop import train

# 12 windows per epoch on the fixture corpus: no epoch ends within these runs.
FAST = ["--batch-size=8", "--bptt=10", "--log-freq=1", "--mirror=off"]
SRC = str(Path(__file__).resolve().parents[2] / "src")


def cli(capsys, corpus, logdir, *args):
    """Runs `mirrorgrad train lm` in-process: (exit status, stdout, stderr)."""
    rc = main(["train", "lm", f"--data={corpus}", f"--logdir={logdir}", *FAST, *args])
    out, err = capsys.readouterr()
    return rc, out, err


def the_error(err: str) -> str:
    """The one error line; fails on a traceback or a second error line."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("mirrorgrad train:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, make_corpus):
    """A corpus and a 2-step run's checkpoint, shared read-only by the tests here."""
    root = tmp_path_factory.mktemp("saved")
    corpus = make_corpus(root / "corpus")
    rc = main(
        ["train", "lm", f"--data={corpus}", f"--logdir={root / 'run'}", *FAST, "--max-steps=2"]
    )
    assert rc == 0
    return corpus, root / "run" / "checkpoints" / "last.pt"


def _container(payload: bytes, *, fmt: int = checkpoint.FORMAT) -> bytes:
    """A checkpoint file around ``payload``, with a correct checksum."""
    header = {"format": fmt, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    return checkpoint.MAGIC + json.dumps(header).encode() + b"\n" + payload


def _payload(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class Opaque:  # a class weights_only=True refuses to unpickle
    pass


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0x5A]) + raw[at + 1 :]


def _other_hex_digit(raw: bytes, at: int) -> bytes:
    digit = b"1" if raw[at : at + 1] == b"0" else b"0"
    return raw[:at] + digit + raw[at + 1 :]


def _damage(kind: str, raw: bytes) -> bytes:
    header_end = raw.index(b"\n") + 1
    return {
        "flipped-payload": lambda: _flip(raw, header_end + (len(raw) - header_end) // 2),
        "flipped-last-byte": lambda: _flip(raw, len(raw) - 1),
        "flipped-checksum": lambda: _other_hex_digit(raw, raw.index(b'"sha256": "') + 11),
        "truncated": lambda: raw[: len(raw) // 2],
        "truncated-header": lambda: raw[: len(checkpoint.MAGIC) + 5],
        "appended": lambda: raw + b"\0",
        "empty": lambda: b"",
        "text": lambda: b"hello, I am a text file\n",
        "plain-torch-save": lambda: _payload({"model": {}}),
        "newer-format": lambda: _container(raw[header_end:], fmt=checkpoint.FORMAT + 1),
        "not-a-dict": lambda: _container(_payload([1, 2, 3])),
        "pickled-object": lambda: _container(_payload({"model": Opaque()})),
        "foreign-dict": lambda: _container(_payload({"weights": torch.zeros(2)})),
    }[kind]()


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("flipped-payload", "damaged checkpoint (its SHA-256 does not match"),
        ("flipped-last-byte", "damaged checkpoint (its SHA-256 does not match"),
        ("flipped-checksum", "damaged checkpoint (its SHA-256 does not match"),
        ("truncated", "truncated checkpoint"),
        ("truncated-header", "damaged checkpoint (unreadable header)"),
        ("appended", "damaged checkpoint"),
        ("empty", "the file is empty"),
        ("text", "not a mirrorgrad checkpoint"),
        ("plain-torch-save", "plain torch.save file"),
        ("newer-format", f"checkpoint format {checkpoint.FORMAT + 1}, this mirrorgrad reads"),
        ("not-a-dict", "holds a list, not a checkpoint"),
        ("pickled-object", "its contents cannot be loaded"),
        ("foreign-dict", "not a checkpoint of `mirrorgrad train lm`"),
    ],
)
def test_bad_checkpoint_stops_before_training(saved, tmp_path, capsys, kind, message):
    corpus, good = saved
    bad = tmp_path / "bad.pt"
    bad.write_bytes(_damage(kind, good.read_bytes()))
    rc, out, err = cli(capsys, corpus, tmp_path / "run", f"--resume={bad}", "--max-steps=3")
    line = the_error(err)
    assert rc == 2 and str(bad) in line and message in line, line
    assert out == ""  # no summary: nothing trained
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()


def test_checksum_covers_every_byte(saved):
    """Any single flipped byte of a checkpoint is refused, wherever it is."""
    raw = saved[1].read_bytes()
    for at in random.Random(0).sample(range(len(raw)), 40):
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.load(_write(saved[1].parent.parent / "flip.pt", _flip(raw, at)))


def _write(path: Path, raw: bytes) -> Path:
    path.write_bytes(raw)
    return path


@pytest.mark.slow
def test_weights_of_another_shape_are_one_line(saved, tmp_path, capsys):
    corpus, good = saved
    state = checkpoint.load(good)
    state["model"]["decoder.bias"] = torch.zeros(3)
    checkpoint.save(state, tmp_path / "odd.pt")
    rc, _, err = cli(capsys, corpus, tmp_path / "run", f"--resume={tmp_path / 'odd.pt'}")
    line = the_error(err)
    assert rc == 2 and "odd.pt: its weights do not fit this model" in line, line


@pytest.mark.slow
def test_training_state_of_another_shape_is_one_line(saved, tmp_path, capsys):
    corpus, good = saved
    state = checkpoint.load(good)
    state["position"]["minute"] = 3  # a key this version does not know
    checkpoint.save(state, tmp_path / "odd.pt")
    rc, _, err = cli(capsys, corpus, tmp_path / "run", f"--resume={tmp_path / 'odd.pt'}")
    line = the_error(err)
    assert rc == 2 and "odd.pt: its training state does not fit this run" in line, line


def test_resume_with_another_model_names_it(saved, tmp_path, capsys):
    corpus, good = saved
    rc, _, err = cli(capsys, corpus, tmp_path / "run", f"--resume={good}", "--model=medium")
    line = the_error(err)
    assert rc == 2 and "--model is 'medium'" in line and "trained with 'tiny'" in line, line


@pytest.mark.slow
def test_resume_compares_values_not_flags(saved, tmp_path, capsys):
    corpus, good = saved  # saved with the tiny model's default dropout, 0.1
    rc, out, err = cli(
        capsys, corpus, tmp_path / "run", f"--resume={good}", "--max-steps=3", "--dropout=0.1"
    )
    assert rc == 0, err
    assert "steps        3" in out
    rc, _, err = cli(capsys, corpus, tmp_path / "run", f"--resume={good}", "--dropout=0.2")
    assert rc == 2 and "--dropout is 0.2" in the_error(err)


@pytest.mark.parametrize(
    "argument",
    [
        "--lr=nan", "--lr=inf", "--lr=-inf", "--lr=0", "--clip=nan", "--clip=inf", "--clip=-1",
        "--dropout=nan", "--dropout=1", "--dropout=-0.5", "--mirror=budget:nan",
        "--mirror=budget:inf", "--mirror=budget:0", "--mirror=budget:1.5", "--mirror=budget:abc",
        "--seed=-1", f"--seed={2**63}", f"--seed={2**80}",
    ],
)  # fmt: skip
def test_bad_number_is_refused_before_any_work(saved, tmp_path, capsys, argument):
    rc, _, err = cli(capsys, saved[0], tmp_path / "run", argument)
    flag = argument.split("=")[0]
    assert rc == 2 and flag in the_error(err)
    assert not (tmp_path / "run").exists()


def _blocked(tmp_path: Path) -> Path:
    """A path no one can create, root included: it runs through a regular file."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    return blocker / "sub"


@pytest.mark.parametrize("option", ["--ckpt-dir", "--logdir"])
def test_folder_under_a_file_fails_before_training(saved, tmp_path, capsys, option):
    folder = _blocked(tmp_path)
    logdir = folder if option == "--logdir" else tmp_path / "run"
    extra = [f"--ckpt-dir={folder}"] if option == "--ckpt-dir" else []
    rc, out, err = cli(capsys, saved[0], logdir, *extra)
    line = the_error(err)
    assert rc == 2 and f"{option} {folder}: cannot create or write there" in line, line
    assert out == ""


def test_folder_that_refuses_files_fails_before_training(saved, tmp_path, capsys):
    # /proc/self is a folder in which no one, root included, may create a file.
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc for a folder that refuses writes to root too")
    rc, _, err = cli(capsys, saved[0], tmp_path / "run", "--ckpt-dir=/proc/self")
    assert rc == 2 and "--ckpt-dir /proc/self: cannot create or write there" in the_error(err)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes through chmod")
def test_read_only_folder_fails_before_training(saved, tmp_path, capsys):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    try:
        rc, _, err = cli(capsys, saved[0], tmp_path / "run", f"--ckpt-dir={folder}")
    finally:
        folder.chmod(0o700)
    assert rc == 2 and "Permission denied" in the_error(err)


def _chattr(flag: str, path: Path) -> bool:
    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.parametrize("kind", ["folder", "immutable", "sticky"])
def test_checkpoint_that_cannot_be_replaced_fails_before_training(
    saved, tmp_path, capsys, monkeypatch, kind
):
    """The preflight checks the file a save replaces, not only its folder: else the run
    trains to the end and loses everything at the final save."""
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    last = ckpt_dir / "last.pt"
    if kind == "folder":
        last.mkdir()
        (last / "notes.txt").write_text("mine")
        reason = "it is a folder"
    else:
        last.write_bytes(b"someone's checkpoint")
    if kind == "immutable":
        if not _chattr("+i", last):
            pytest.skip("needs chattr +i (root, a file system with the flag)")
        reason = "it is immutable or append-only"
    if kind == "sticky":  # /tmp: the file and the folder are another user's
        ckpt_dir.chmod(0o1777)
        monkeypatch.setattr(preflight.os, "geteuid", lambda: last.stat().st_uid + 12345)
        reason = "another user owns it in a sticky folder"
    try:
        rc, out, err = cli(capsys, saved[0], tmp_path / "run", f"--ckpt-dir={ckpt_dir}")
    finally:
        if kind == "immutable":
            _chattr("-i", last)
    line = the_error(err)
    assert rc == 2 and f"the checkpoint {last} cannot be replaced ({reason})" in line, line
    assert out == "" and "--ckpt-dir" in line
    assert last.is_dir() if kind == "folder" else last.read_bytes() == b"someone's checkpoint"


@pytest.mark.slow
def test_missing_folders_are_created(saved, tmp_path, capsys):
    deep = tmp_path / "a" / "b"
    rc, _, err = cli(capsys, saved[0], deep / "log", f"--ckpt-dir={deep / 'ckpt'}", "--max-steps=1")
    assert rc == 0, err
    assert (deep / "ckpt" / "last.pt").is_file()
    assert not list(deep.glob("*/.mirrorgrad-probe-*"))


def test_resume_from_a_missing_checkpoint(saved, tmp_path, capsys):
    rc, _, err = cli(capsys, saved[0], tmp_path / "run", "--resume")
    assert rc == 2 and "no checkpoint there" in the_error(err)


def test_unreadable_data_is_one_line(saved, tmp_path, capsys, monkeypatch):
    corpus = saved[0]
    real_read = Path.read_bytes

    def failing_read(path):
        if path.parent == corpus:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real_read(path)

    monkeypatch.setattr(data.Path, "read_bytes", failing_read)
    rc, _, err = cli(capsys, corpus, tmp_path / "run")
    line = the_error(err)
    assert rc == 2 and "--data: cannot read" in line and "Input/output error" in line, line


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="needs /dev/null")
def test_data_that_is_a_device_reads_as_a_file(tmp_path, capsys):
    rc, _, err = cli(capsys, "/dev/null", tmp_path / "run")
    assert rc == 2 and "/dev/null is empty" in the_error(err)


@pytest.mark.slow
@pytest.mark.parametrize("full_from_save", [1, 2])
def test_disk_failure_while_saving_is_one_line(
    saved, tmp_path, capsys, monkeypatch, full_from_save
):
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs Linux's /proc to tell a checkpoint's file descriptor")
    real_fsync, saves = os.fsync, itertools.count(1)

    def full_disk_for_checkpoints(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp") and next(saves) >= full_from_save:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", full_disk_for_checkpoints)
    rc, _, err = cli(capsys, saved[0], tmp_path / "run", "--max-steps=3", "--ckpt-every=1")
    line = the_error(err)
    assert rc == 1 and "cannot save the checkpoint (No space left on device)" in line, line
    ckpt_dir = tmp_path / "run" / "checkpoints"
    if full_from_save == 1:  # the first save: there is no previous one to keep
        assert line.endswith("; no checkpoint was saved"), line
        assert not list(ckpt_dir.iterdir())  # no temporary left
    else:
        assert line.endswith("; the previous one is kept"), line
        assert [p.name for p in ckpt_dir.iterdir()] == ["last.pt"]
        assert checkpoint.load(ckpt_dir)["position"]["step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("log_freq", "kept_step"),
    [(1, None), (100, 2)],  # found at the log of step 3 / at the save after step 3
)
def test_non_finite_step_stops_and_keeps_the_last_good_checkpoint(
    saved, tmp_path, capsys, monkeypatch, log_freq, kept_step
):
    real_clip, calls = torch.nn.utils.clip_grad_norm_, itertools.count(1)

    def poisoned_clip(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        if next(calls) == 3:  # the third step's gradient overflows
            parameters[0].grad.fill_(float("inf"))
        return real_clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned_clip)
    ckpt_every = 100 if kept_step is None else 1
    args = ["--max-steps=8", f"--ckpt-every={ckpt_every}", f"--log-freq={log_freq}"]
    rc, out, err = cli(capsys, saved[0], tmp_path / "run", *args)
    line = the_error(err)
    assert rc == 1 and "not finite at step 3" in line and "--lr" in line, line
    assert out == ""
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    if kept_step is None:
        assert "no checkpoint was saved" in line and not last.exists()
    else:
        state = checkpoint.load(last)
        assert state["position"]["step"] == kept_step
        assert all(torch.isfinite(t).all() for t in state["model"].values())


@pytest.mark.slow
def test_stale_temporaries_are_removed_at_start(saved, tmp_path, capsys):
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    dead = ckpt_dir / f".last.pt.{_dead_pid()}.tmp"
    live = ckpt_dir / f".last.pt.{os.getppid()}.tmp"  # a save in progress elsewhere
    other = ckpt_dir / f".notes.{_dead_pid()}.tmp"  # not ours
    for path in (dead, live, other):
        path.write_bytes(b"half a checkpoint")
    rc, _, err = cli(capsys, saved[0], tmp_path / "run", "--max-steps=1")
    assert rc == 0, err
    assert not dead.exists() and live.exists() and other.exists()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _signal_then(signum, real, *, swallowed=False):
    """``real``, after ``signum`` came (its handler has run when raise_signal returns).
    ``swallowed``: its exception is caught, as Dynamo's guard checks and Python's
    weakref callbacks catch everything (a SIGTERM in setup was lost that way)."""

    def call(*args, **kwargs):
        try:
            signal.raise_signal(signum)
        except KeyboardInterrupt:
            if not swallowed:
                raise
        return real(*args, **kwargs)

    return call


# Where a signal lands, and what the run must do: "line" (one line, nothing printed
# on stdout, no checkpoint unless the steps ran) or "summary" (stop after the step,
# save, print the summary). Each ends with the shell's status for the signal.
_MOMENTS = {
    "data": ((data, "load_corpus"), False, "line", None),
    "plan": ((probes, "explain_plan"), False, "line", None),
    "plan, swallowed": ((probes, "explain_plan"), True, "line", None),
    "compile": ((mirrorgrad, "compile"), False, "line", None),
    "first step": ((loop.StepLoop, "_step"), False, "summary", 1),
    "final save": ((checkpoint, "save"), False, "summary", 2),
    "final evaluation": ((evaluation, "final_losses"), False, "line", 2),
    "final evaluation, swallowed": ((evaluation, "final_losses"), True, "line", 2),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("moment", "signum"),
    [(moment, signal.SIGTERM) for moment in _MOMENTS]
    + [("data", signal.SIGINT), ("first step", signal.SIGINT), ("final save", signal.SIGINT)],
    ids=lambda value: value.name if isinstance(value, signal.Signals) else value,
)
def test_a_signal_at_any_moment_ends_the_run(saved, tmp_path, capsys, monkeypatch, moment, signum):
    (owner, name), swallowed, outcome, saved_step = _MOMENTS[moment]
    monkeypatch.setattr(
        owner, name, _signal_then(signum, getattr(owner, name), swallowed=swallowed)
    )
    rc, out, err = cli(capsys, saved[0], tmp_path / "run", "--max-steps=2")
    assert rc == 128 + signum, err  # what a shell shows: 130 for SIGINT, 143 for SIGTERM
    name = signal.Signals(signum).name
    if outcome == "line":
        assert the_error(err) == f"mirrorgrad train: interrupted by {name}" and out == ""
    else:
        assert f"interrupted by {name}: tiny LSTM LM" in out and "Traceback" not in err
        assert "valid n/a  test n/a" in out  # no evaluation after a stop
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    assert (checkpoint.load(last)["position"]["step"] if last.exists() else None) == saved_step
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


@pytest.mark.slow
def test_sigterm_during_the_steps_saves_and_resumes(saved, tmp_path, capsys, monkeypatch):
    real_step, calls = loop.StepLoop._step, itertools.count(1)

    def step_then_term(self, x, y):
        loss = real_step(self, x, y)
        if next(calls) == 2:
            signal.raise_signal(signal.SIGTERM)
        return loss

    monkeypatch.setattr(loop.StepLoop, "_step", step_then_term)
    rc, out, err = cli(capsys, saved[0], tmp_path / "run", "--max-steps=5")
    assert rc == 143 and "interrupted by SIGTERM:" in out and "Traceback" not in err
    assert checkpoint.load(tmp_path / "run" / "checkpoints")["position"]["step"] == 2
    monkeypatch.undo()
    rc, out, _ = cli(capsys, saved[0], tmp_path / "run", "--max-steps=5", "--resume")
    assert rc == 0 and "steps        5" in out


def _lr_of(path: Path) -> float:
    return checkpoint.load(path)["optimizer"]["param_groups"][0]["lr"]


@pytest.mark.slow
def test_resume_goes_on_at_the_checkpoints_lr_unless_lr_is_given(saved, tmp_path, capsys):
    corpus, good = saved
    assert _lr_of(good) == 20.0  # the tiny model's default
    ckpt = tmp_path / "ckpt"
    argv = [f"--resume={good}", "--max-steps=3", f"--ckpt-dir={ckpt}"]
    rc, _, err = cli(capsys, corpus, tmp_path / "run", *argv)
    assert rc == 0 and "--lr" not in err and _lr_of(ckpt / "last.pt") == 20.0
    rc, _, err = cli(capsys, corpus, tmp_path / "run", *argv, "--lr=20")  # the same: no news
    assert rc == 0 and "--lr" not in err
    rc, _, err = cli(capsys, corpus, tmp_path / "run", *argv, "--lr=0.5")
    notes = [line for line in err.splitlines() if "--lr" in line]
    assert rc == 0 and notes == [
        f"--lr 0.5 replaces the lr of {good} (20); the schedule goes on from 0.5"
    ]
    assert _lr_of(ckpt / "last.pt") == 0.5


@pytest.mark.slow
def test_resume_with_a_huge_lr_trains_at_it_and_keeps_the_checkpoint(saved, tmp_path, capsys):
    corpus, good = saved
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "last.pt").write_bytes(good.read_bytes())
    argv = [f"--ckpt-dir={ckpt}", "--resume", "--max-steps=5", "--lr=1e38"]
    rc, out, err = cli(capsys, corpus, tmp_path / "run", *argv)
    line = the_error(err)
    assert rc == 1 and "the checkpoint of step 2 is kept. Lower --lr (now 1e+38)" in line, line
    assert out == "" and (ckpt / "last.pt").read_bytes() == good.read_bytes()


# -- real processes ----------------------------------------------------------------------


def _child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", code, *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Ctrl-C as in a terminal, even when pytest itself runs with SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


_PAUSE_IN_SETUP_THEN_TRAIN = """
import sys, time
from mirrorgrad.cli import main
from mirrorgrad.train import probes

real_explain = probes.explain_plan

def explain_once_signalled(*args):
    print("in setup", flush=True)  # data loaded, the plan and the compile to come
    time.sleep(120)  # the test's signal ends this; without it, training goes on
    return real_explain(*args)

probes.explain_plan = explain_once_signalled
sys.exit(main(["train", "lm", *sys.argv[1:]]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_setup_of_a_real_process(saved, tmp_path, signum):
    run = tmp_path / "run"
    child = _child(_PAUSE_IN_SETUP_THEN_TRAIN, f"--data={saved[0]}", f"--logdir={run}", *FAST)
    try:
        assert read_line(child.stdout) == "in setup\n", child.stderr.read()
        child.send_signal(signum)
        out, err = child.communicate(timeout=TIMEOUT_S)
    finally:
        child.kill()
    assert child.returncode == 128 + signum, err
    assert err.strip() == f"mirrorgrad train: interrupted by {signal.Signals(signum).name}"
    assert out == "" and not (run / "checkpoints" / "last.pt").exists()


_TRAIN = """
import sys
from mirrorgrad.cli import main
sys.exit(main(["train", "lm", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_kill_9_during_training_then_resume_equals_uninterrupted(saved, tmp_path):
    corpus, run = saved[0], tmp_path / "killed"
    # --epochs: still training when killed, however long the test took to look.
    args = [f"--data={corpus}", f"--logdir={run}", *FAST, "--ckpt-every=1"]
    args += ["--max-steps=10000", "--epochs=1000"]
    child = _child(_TRAIN, *args)
    last = run / "checkpoints" / "last.pt"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while _saved_step(last) < 3:
            assert child.poll() is None, child.stderr.read()
            assert time.monotonic() < deadline, f"no checkpoint of step 3 in {TIMEOUT_S:g} s"
            time.sleep(0.05)
        child.kill()  # kill -9, most likely in the middle of a step or a save
    finally:
        child.communicate(timeout=30)
    killed_at = checkpoint.load(last)["position"]["step"]
    steps = killed_at + 3

    def config(logdir, **kw):
        return TrainConfig.from_preset(
            "tiny", data=corpus, logdir=logdir, batch_size=8, bptt=10, log_freq=1,
            mirror=MirrorOptions.from_cli("off"), max_steps=steps, epochs=1000, **kw,
        )  # fmt: skip

    # epochs=1000: max_steps decides where both runs stop, wherever the kill landed
    # (a kill after the 10th of an epoch's 12 steps asked for 13 steps of 12).
    resumed = train(config(run, resume=run / "checkpoints"))
    whole = train(config(tmp_path / "whole"))
    assert resumed.steps == whole.steps == steps
    # Equal up to float rounding: the killed steps ran in another process, whose BLAS may
    # split its sums differently on a loaded machine (CI saw 2e-7 relative); a resume
    # from the wrong window, RNG or optimizer state moves the perplexity by far more.
    assert resumed.train_perplexity == pytest.approx(whole.train_perplexity, rel=1e-5)
    assert resumed.test_perplexity == pytest.approx(whole.test_perplexity, rel=1e-5)
    assert not list(last.parent.glob(".*.tmp"))


def _saved_step(path: Path) -> int:
    try:
        return checkpoint.load(path)["position"]["step"]
    except checkpoint.CheckpointError:
        return -1  # not written yet


_SAVE_TWICE_AND_PAUSE = """
import sys, time, torch
from pathlib import Path
from mirrorgrad.train import checkpoint
path, pause_after = Path(sys.argv[1]), sys.argv[2]
state = {"weights": torch.zeros(100_000)}

def pausing(name, real):
    def step(*args):
        real(*args)
        if state["i"] == 1 and name == pause_after:
            print("paused", flush=True)
            time.sleep(60)
    return step

# "fsync": the new file is written and synced but not renamed; "rename": it is renamed.
checkpoint.os.fsync = pausing("fsync", checkpoint.os.fsync)
checkpoint._sync_folder = pausing("rename", checkpoint._sync_folder)
for i in range(2):
    state["i"] = i
    state["weights"].fill_(i)
    checkpoint.save(state, path)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("pause_after", "survivor"), [("fsync", 0), ("rename", 1)])
def test_kill_9_during_a_save_leaves_the_old_or_the_new_checkpoint(tmp_path, pause_after, survivor):
    path = tmp_path / "last.pt"
    child = _child(_SAVE_TWICE_AND_PAUSE, str(path), pause_after)
    try:
        assert read_line(child.stdout) == "paused\n", child.stderr.read()
        child.kill()
    finally:
        child.communicate(timeout=30)
    temporaries = list(tmp_path.glob(".last.pt.*.tmp"))
    assert len(temporaries) == (1 if pause_after == "fsync" else 0)
    state = checkpoint.load(path)  # intact: the checksum holds
    assert state["i"] == survivor and bool((state["weights"] == survivor).all())
    assert checkpoint.remove_stale_temporaries(tmp_path) == temporaries
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
