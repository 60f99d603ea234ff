"""`mirrorgrad bench`: every workload x method, one worker process per workload.

Each workload runs in a fresh ``python -m mirrorgrad.bench.runner`` process (clean
allocator and compile caches); its methods run there in sequence, so ratios compare
methods measured side by side. A method that fails, hangs past ``--method-timeout``
or kills its worker is recorded with the reason and the rest go on in a new worker.
The largest batch under a memory cap is a study of its own: benchmarks/max_batch.py.

results.json and results.md are rewritten (atomically) after every finished method, so a
run stopped at any moment (SIGTERM, Ctrl-C, a machine taken back) leaves what it measured.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import fnmatch
import json
import math
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TextIO

from tqdm import tqdm

from mirrorgrad._folders import FolderNotWritable, probe_writable
from mirrorgrad.bench import report, runner
from mirrorgrad.bench.methods import Method
from mirrorgrad.bench.provenance import git_commit
from mirrorgrad.bench.runner import DTYPES, FATAL_EXIT, MARKER, check_device
from mirrorgrad.bench.suites import METHODS, SUITES, WORKLOADS, Suite, register, suite_of

_QUICK_DEFAULTS = {"steps": 3, "warmup": 2, "backend": "eager"}
_FULL_DEFAULTS = {"steps": 20, "warmup": 3, "backend": "inductor"}
# Pre-compiling's share of --time-limit.
_PRECOMPILE_SHARE = 0.4
NOT_RUN = ("not run", "stopped before this method")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _selection_arguments(parser)
    _measurement_arguments(parser)
    _time_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--from-json", type=Path, metavar="RESULTS",
                        help="run nothing: redraw the markdown and plots of a "
                        "results.json into --out")  # fmt: skip


def _selection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", choices=list(SUITES), default="planner",
                        help="which suite: its workloads and methods (default "
                        "planner); --list names them")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="list suites and workloads, run none")
    parser.add_argument("--workloads", "--models", nargs="+", metavar="NAME",
                        help="workloads (shell patterns, e.g. 'hf-*'); default: all "
                        "of the suite's")  # fmt: skip
    parser.add_argument("--limit", type=int, help="only the first N workloads selected")
    methods = ", ".join(METHODS)
    parser.add_argument("--methods", nargs="+", metavar="NAME",
                        help=f"default: all that apply to each workload, of {methods}")


def _measurement_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes on the CPU, backend eager (for tests)")  # fmt: skip
    parser.add_argument("--steps", type=int, help="timed steps per method (default 20; quick 3)")
    parser.add_argument("--warmup", type=int, help="warm-up steps, the first compiles (default 3)")
    parser.add_argument("--backend", choices=["inductor", "eager"],
                        help="code generation for compiling methods (default "
                        "inductor; quick: eager)")  # fmt: skip
    parser.add_argument("--device", help="default: cuda if available (cpu with --quick)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, profile 5 more per method: "
                        "logs/<workload>.<method>.txt")  # fmt: skip


def _time_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--time-limit", type=float,
                        help="seconds; methods not started by then are skipped")  # fmt: skip
    parser.add_argument("--method-timeout", type=float, help="seconds one method may take")
    parser.add_argument("--workload-time", type=float,
                        help="seconds one workload's methods may take in all; the "
                        "rest are skipped")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1,
                        help="workloads measured at a time (default 1). Peaks and gradients "
                        "stay exact; with more than one, times share the device and are only "
                        "indicative")  # fmt: skip
    parser.add_argument("--precompile-jobs", type=int, default=0,
                        help="first compile every compiling method N processes at a time, so "
                        "the timed runs find Inductor's caches warm (their compile times are "
                        "then warm; the cold ones, N-way parallel, go to results.json)")


def _names(values: list[str] | None) -> list[str] | None:
    """Accept both `--methods a b` and `--methods a,b`."""
    if values is None:
        return None
    return [name for value in values for name in value.split(",") if name]


def _check(names: list[str] | None, known: dict[str, Any], what: str) -> None:
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise _Fail(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")


class _Worker:
    """One runner process; its result lines arrive on a queue (None when it exits)."""

    live: ClassVar[set[_Worker]] = set()  # killed all at once when the run is stopped

    def __init__(self, cmd: list[str], log: TextIO, env: dict[str, str] | None = None) -> None:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        _Worker.live.add(self)
        self.records: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARKER):
                self.records.put(json.loads(line[len(MARKER) :]))
        self.records.put(None)

    def next(self, timeout: float | None) -> dict[str, Any] | None:
        """The next record; None once the worker has exited; queue.Empty on timeout."""
        return self.records.get(timeout=timeout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        _Worker.live.discard(self)
        return self.proc.wait()


def _not_run(workload: str, method: str, status: str, error: str) -> dict[str, Any]:
    return {"workload": workload, "method": method, "status": status, "error": error}


@dataclass(kw_only=True, slots=True)
class _WorkerSettings:
    """How the workers of one phase (precompile, timed run) run."""

    steps: int
    warmup: int
    name: str  # logs/<workload>.<name>.log
    # Methods not started by `deadline` are skipped; a worker busy at `kill_at` is killed.
    deadline: float | None = None
    kill_at: float | None = None
    env: dict[str, str] | None = None
    # Called with (workload, its results so far) after each method of the workload ends.
    on_result: Callable[[str, dict[str, dict[str, Any]]], None] | None = None


class _Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        defaults = _QUICK_DEFAULTS if args.quick else _FULL_DEFAULTS
        self.steps = args.steps or defaults["steps"]
        self.warmup = args.warmup or defaults["warmup"]
        self.backend = args.backend or defaults["backend"]
        self.env: dict[str, Any] = {}
        self.logs = args.out / "logs"
        self.stopping = False  # set by a signal: no new workers, no more results
        self._grads_dir: Path | None = None

    def stop(self) -> None:
        self.stopping = True
        for worker in list(_Worker.live):
            if worker.proc.poll() is None:
                worker.proc.kill()

    def worker_cmd(
        self, workload: str, methods: list[str], settings: _WorkerSettings, **extra: Any
    ) -> list[str]:
        a = self.args
        # The chosen suite's worker: a script's registers its methods first.
        worker = SUITES[a.suite].worker_command()
        cmd = [sys.executable, *worker, "--workload", workload]
        cmd += ["--methods", ",".join(methods), "--dtype", a.dtype, "--backend", self.backend]
        options = {
            "steps": settings.steps,
            "warmup": settings.warmup,
            "device": a.device,
            "deadline": settings.deadline,
        }
        for key, value in (options | extra).items():
            if value is not None:
                cmd += [f"--{key.replace('_', '-')}", str(value)]
        if a.quick:
            cmd.append("--quick")
        if settings.name == "run" and WORKLOADS[workload].grad_reference is not None:
            cmd += ["--grads-file", str(self.grads_file(workload))]
        if settings.name == "run" and a.profile:
            cmd += ["--profile-dir", str(self.logs)]
        return cmd

    def grads_file(self, workload: str) -> Path:
        """Under the system's temp folder, not --out: the files can be 100s of MiB."""
        if self._grads_dir is None:
            self._grads_dir = Path(tempfile.mkdtemp(prefix="mirrorgrad-bench-grads-"))
        return self._grads_dir / f"{workload}.reference-grads.pt"

    def remove_grads(self) -> None:
        if self._grads_dir is not None:
            shutil.rmtree(self._grads_dir, ignore_errors=True)

    def worker_env(self, jobs: int) -> dict[str, str] | None:
        """With several workers at a time, Inductor's compile threads are shared out."""
        if jobs <= 1:
            return None
        threads = max(1, (os.cpu_count() or 2) // jobs)
        return os.environ | {"TORCHINDUCTOR_COMPILE_THREADS": str(threads)}

    def _timeout(self, settings: _WorkerSettings) -> float | None:
        """Seconds to wait for the next record: the method timeout, or less near kill_at."""
        limits = [self.args.method_timeout]
        if settings.kill_at is not None:
            limits.append(max(0.0, settings.kill_at - time.time()))
        return min((t for t in limits if t is not None), default=None)

    def run_workload(
        self, workload: str, methods: list[str], settings: _WorkerSettings, bar: tqdm
    ) -> list[dict[str, Any]]:
        results: dict[str, dict[str, Any]] = {}
        missing = WORKLOADS[workload].missing_packages()
        if missing:
            bar.update(len(methods))
            reason = f"not installed: {', '.join(missing)}"
            return [_not_run(workload, name, "skipped", reason) for name in methods]
        # The gradient reference runs first: the others compare with its gradients.
        reference = WORKLOADS[workload].grad_reference
        pending = sorted(methods, key=lambda name: name != reference)
        if reference in methods:  # an earlier run's reference must not stand in for it
            self.grads_file(workload).unlink(missing_ok=True)
        with open(self.logs / f"{workload}.{settings.name}.log", "a") as log:
            while pending and not self.stopping:
                if settings.deadline is not None and time.time() > settings.deadline:
                    for name in pending:
                        results[name] = _not_run(workload, name, "skipped", "time limit reached")
                    bar.update(len(pending))
                    break
                worker = _Worker(self.worker_cmd(workload, pending, settings), log, settings.env)
                if self.stopping:  # stopped while it started: stop() missed it
                    worker.stop()
                try:
                    lost = self._collect(worker, workload, pending, results, settings, bar)
                finally:
                    worker.stop()
                if lost is not None:
                    # The method running when its worker hung, died or was stopped is
                    # lost; the rest go on in a new worker.
                    name = pending.pop(0)
                    results[name] = _not_run(workload, name, *lost)
                    bar.update(1)
                    self._report(workload, results, settings)
        for name in pending:  # only when stopped
            results[name] = _not_run(workload, name, *NOT_RUN)
        return [results[name] for name in methods]

    def _report(
        self, workload: str, results: dict[str, dict[str, Any]], settings: _WorkerSettings
    ) -> None:
        if settings.on_result is not None and not self.stopping:
            settings.on_result(workload, results)

    def _collect(
        self,
        worker: _Worker,
        workload: str,
        pending: list[str],
        results: dict[str, dict[str, Any]],
        settings: _WorkerSettings,
        bar: tqdm,
    ) -> tuple[str, str] | None:
        """Move the worker's results from ``pending`` to ``results``; (status, reason)
        if the worker hung, died or was stopped with a method unreported, else None."""
        while pending:
            bar.set_description(f"{workload} / {pending[0]}")
            try:
                record = worker.next(self._timeout(settings))
            except queue.Empty:
                if settings.kill_at is not None and time.time() >= settings.kill_at:
                    return "skipped", "stopped at the time limit"
                return "failed", f"timed out after {self.args.method_timeout:g} s"
            if record is None:
                code = worker.stop()
                if code == FATAL_EXIT:  # it reported the method that broke CUDA
                    return None
                log = f"logs/{workload}.{settings.name}.log"
                return "failed", f"worker exited with code {code}; see {log}"
            if record.pop("kind") == "env":
                self.env = self.env or record
                continue
            results[record["method"]] = record
            pending.remove(record["method"])
            bar.update(1)
            self._report(workload, results, settings)
        return None

    def precompile(
        self, plan: dict[str, list[str]], jobs: int, deadline: float | None
    ) -> dict[tuple[str, str], dict[str, Any]]:
        """Compile each (workload, compiling method) once, ``jobs`` processes at a time,
        so that the timed runs find Inductor's caches warm. Returns those one-step
        results: their compile times are cold, but measured ``jobs``-way parallel."""
        todo = [(w, m) for w, ms in plan.items() for m in ms if METHODS[m].compiles]
        # Longest first: the slowest compiles do not start last and hold up the phase.
        todo.sort(key=lambda job: -WORKLOADS[job[0]].compile_weight)
        settings = _WorkerSettings(
            steps=1,
            warmup=1,
            name="precompile",
            deadline=deadline,
            kill_at=deadline,
            env=self.worker_env(jobs) or dict(os.environ),
        )
        bar = tqdm(total=len(todo), unit="compile", disable=self.args.no_progress, file=sys.stderr)
        with bar, concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            futures = {
                pool.submit(self.run_workload, w, [m], settings, bar): (w, m) for w, m in todo
            }
            return {futures[f]: f.result()[0] for f in concurrent.futures.as_completed(futures)}


def _command_line(args: argparse.Namespace) -> str:
    script = SUITES[args.suite].script
    parts = ["mirrorgrad", "bench"]
    if script is not None:
        parts = ["python", f"{script.parent.name}/{script.name}"]
    if args.suite != "planner" and script is None:
        parts += ["--suite", args.suite]
    for key in ("workloads", "methods"):
        if getattr(args, key):
            parts += [f"--{key.replace('_', '-')}", *getattr(args, key)]
    keys = ("limit", "dtype", "steps", "warmup", "backend", "device", "time_limit")
    for key in (*keys, "method_timeout", "workload_time", "jobs", "precompile_jobs"):
        if getattr(args, key):
            parts += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.quick:
        parts.append("--quick")
    return shlex.join(parts)


def _share(now: float, end: float | None, parts: int) -> float | None:
    """A fair share of the time left: what earlier parts did not use goes to later ones."""
    return None if end is None else now + max(0.0, end - now) / parts


def _write_atomic(path: Path, text: str) -> None:
    """A reader (or a kill) sees the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _suite_of_doc(doc: dict[str, Any]) -> Suite | None:
    """The registered suite that wrote ``doc`` (None: one this process does not know)."""
    return SUITES.get(doc.get("suite", "planner"))


def _write_results(doc: dict[str, Any], out: Path) -> str:
    """results.json and results.md (no plots: those take seconds); returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "results.json", json.dumps(doc, indent=1, allow_nan=False))
    suite = _suite_of_doc(doc)
    lead = suite.table(doc) if suite is not None and suite.table is not None else ""
    table = report.markdown(doc, lead, lead_only=bool(suite and suite.table_only))
    _write_atomic(out / "results.md", table)
    return table


def _write_report(doc: dict[str, Any], out: Path) -> None:
    table = _write_results(doc, out)
    files = report.plots(doc, out)
    suite = _suite_of_doc(doc)
    if suite is not None and suite.files is not None:
        files += suite.files(doc, out)
    print(report.summary(doc))
    names = ", ".join(p.name for p in files)
    print(f"\nwrote {out / 'results.json'}, results.md" + (f", {names}" if names else "") + "\n")
    print(table)


def _redraw(path: Path, out: Path) -> int:
    """``--from-json``: tables and plots of a saved results file."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise _Fail(f"--from-json: cannot read {path}: {reason}") from None
    except json.JSONDecodeError as e:
        raise _Fail(f"--from-json: {path} is not JSON ({e})") from None
    missing = _missing_from_results(doc)
    if missing is not None:
        raise _Fail(f"--from-json: {path} is not a results.json of mirrorgrad bench: {missing}")
    try:
        for workload in doc["workloads"].values():
            # Files older than a ratio get it too.
            report.add_ratios(workload["methods"], report.baselines_of(doc))
        _write_report(doc, out)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a value of the wrong kind
        raise _Fail(f"--from-json: cannot draw {path} ({type(e).__name__}: {e})") from None
    return 0


# What the report reads of a results.json: keys and what they hold.
_RESULTS_KEYS = {"workloads": dict, "env": dict, "options": dict}
_METHOD_KEYS = ("method", "status")
_MEASURED_KEYS = ("median_ms", "peak_bytes", "samples_per_s")  # of an "ok" method


def _missing_from_results(doc: Any) -> str | None:
    """What a results.json lacks for the report, in a few words; None if nothing."""
    if not isinstance(doc, dict):
        return f"a JSON object at the top, not a {type(doc).__name__}"
    for key, kind in _RESULTS_KEYS.items():
        if not isinstance(doc.get(key), kind):
            return f"no {key!r} object"
    if "dtype" not in doc["options"]:
        return "no 'dtype' in 'options'"
    for name, workload in doc["workloads"].items():
        methods = workload.get("methods") if isinstance(workload, dict) else None
        if not isinstance(methods, list):
            return f"workload {name!r} has no 'methods' list"
        for i, m in enumerate(methods):
            if not isinstance(m, dict):
                return f"method {i} of workload {name!r} is not an object"
            keys = _METHOD_KEYS + (_MEASURED_KEYS if m.get("status") == "ok" else ())
            absent = [k for k in keys if k not in m]
            if absent:
                return f"method {i} of workload {name!r} has no {', '.join(map(repr, absent))}"
    return None


class _Fail(Exception):
    """An error in what the user asked for, found before any work: one line, exit status 2."""


def _select(args: argparse.Namespace) -> tuple[Suite, dict[str, list[str]]]:
    """The suite and its plan: workload -> methods, after --workloads, --methods, --limit."""
    suite = SUITES[args.suite]
    names = suite.workload_names(args.quick)
    patterns = _names(args.workloads)
    if patterns:
        unknown = [p for p in patterns if not fnmatch.filter(WORKLOADS, p)]
        if unknown:
            raise _Fail(
                f"unknown workload {', '.join(unknown)}; `mirrorgrad bench --list` names them"
            )
        pool = names if all(fnmatch.filter(names, p) for p in patterns) else list(WORKLOADS)
        names = [n for n in pool if any(fnmatch.fnmatch(n, p) for p in patterns)]
    if args.limit is not None:
        names = names[: args.limit]
    requested = _names(args.methods)
    _check(requested, METHODS, "method")
    plan = {}
    for name in names:
        workload = WORKLOADS[name]
        owner = suite if name in suite.workloads else suite_of(name)
        methods = requested or owner.methods_for(workload)
        plan[name] = [m for m in methods if workload.recurrent or not METHODS[m].swap_rnn]
    return suite, plan


def _document(args: argparse.Namespace, bench: _Bench, suite: Suite) -> dict[str, Any]:
    commit, dirty = git_commit()
    return {
        "schema": 1,
        "suite": suite.name,
        "baselines": list(suite.baselines),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command_line(args),
        "git_commit": commit,
        "git_dirty": dirty,
        "options": {
            "dtype": args.dtype,
            "steps": bench.steps,
            "warmup": bench.warmup,
            "backend": bench.backend,
            "quick": args.quick,
            "jobs": args.jobs,
            "precompile_jobs": args.precompile_jobs,
        },
        "env": {},
        "workloads": {},
    }


class _Progress:
    """The results document, rewritten to --out after every finished method."""

    def __init__(self, doc: dict[str, Any], plan: dict[str, list[str]], bench: _Bench) -> None:
        self.doc, self.plan, self.bench = doc, plan, bench
        self.cold: dict[tuple[str, str], dict[str, Any]] = {}
        self.lock = threading.Lock()
        doc["complete"], doc["stopped"] = False, None
        for name, methods in plan.items():
            self.doc["workloads"][name] = {
                "description": WORKLOADS[name].description,
                "methods": [_not_run(name, m, *NOT_RUN) for m in methods],
            }

    def update(self, name: str, results: dict[str, dict[str, Any]]) -> None:
        """``name``'s results so far; its methods not in ``results`` are marked not run."""
        methods = [results.get(m) or _not_run(name, m, *NOT_RUN) for m in self.plan[name]]
        for m in methods:
            warm = self.cold.get((name, m["method"]))
            if warm is not None:
                m["cold_compile_s"] = warm.get("compile_s")
                m["precompile_error"] = warm.get("error")
        report.add_ratios(methods, self.doc["baselines"])
        with self.lock:
            self.doc["workloads"][name]["methods"] = methods
            self.save()

    def save(self) -> None:
        """Write results.json and results.md as they stand (call with the lock held)."""
        self.doc["env"] = self.bench.env
        _write_results(self.doc, self.bench.args.out)


def _timed_runs(bench: _Bench, progress: _Progress, timed_end: float | None) -> None:
    """Every workload's methods, ``--jobs`` workers at a time; results into the document."""
    args, plan = bench.args, progress.plan
    total = sum(len(methods) for methods in plan.values())
    lock = threading.Lock()
    counter = iter(range(len(plan)))

    def one(name: str, methods: list[str]) -> None:
        with lock:
            left = len(plan) - next(counter)
        now = time.time()
        # A fair share of the time left, or with --workload-time that much (a sweep of
        # many models: a slow one must not take the time of the next).
        deadline = _share(now, timed_end, max(1, -(-left // args.jobs)))
        kill_at = timed_end
        if args.workload_time:
            deadline = kill_at = min(timed_end or math.inf, now + args.workload_time)
        settings = _WorkerSettings(
            steps=bench.steps, warmup=bench.warmup, name="run", deadline=deadline,
            kill_at=kill_at, env=bench.worker_env(args.jobs), on_result=progress.update,
        )  # fmt: skip
        results = bench.run_workload(name, methods, settings, bar)
        if not bench.stopping:
            progress.update(name, {m["method"]: m for m in results})

    bar = tqdm(total=total, unit="method", disable=args.no_progress, file=sys.stderr)
    with bar, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for future in [pool.submit(one, name, methods) for name, methods in plan.items()]:
            future.result()


def _list_suites() -> int:
    for suite in SUITES.values():
        cpu = suite.workload_names(quick=True)
        print(f"{suite.name}: {suite.description}")
        print(f"  methods: {', '.join(suite.methods or ('the planner suite methods',))}")
        for name, w in suite.workloads.items():
            mark = " (cpu slice)" if name in cpu and len(cpu) < len(suite.workloads) else ""
            print(f"  {name}{mark}: {w.description}")
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.list:
        return _list_suites()
    if args.from_json is not None:
        return _redraw(args.from_json, args.out)
    start = time.time()
    suite, plan = _select(args)
    bench = _Bench(args)
    bench.logs.mkdir(parents=True, exist_ok=True)
    progress = _Progress(_document(args, bench, suite), plan, bench)
    progress.save()
    try:
        with _stop_on_signals(bench):
            _phases(bench, progress, start)
    except _Stopped as e:
        with progress.lock:
            progress.doc["stopped"] = e.signal_name
            progress.save()
        done = sum(m["status"] != NOT_RUN[0] for m in _all_methods(progress.doc))
        total = len(_all_methods(progress.doc))
        print(f"mirrorgrad bench: stopped by {e.signal_name}; {done} of {total} methods "
              f"finished, written to {args.out / 'results.json'} and results.md "
              "(plots: --from-json)", file=sys.stderr)  # fmt: skip
        return 128 + e.signum
    finally:
        bench.remove_grads()
    progress.doc["complete"] = True
    progress.doc["wall_s"] = round(time.time() - start, 1)
    _write_report(progress.doc, args.out)
    return 0


def _all_methods(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for w in doc["workloads"].values() for m in w["methods"]]


class _Stopped(BaseException):
    """SIGTERM or SIGINT arrived: the run ends, writing what it has."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum, self.signal_name = signum, signal.Signals(signum).name


@contextlib.contextmanager
def _stop_on_signals(bench: _Bench) -> Iterator[None]:
    """SIGTERM (what ``timeout`` sends) and SIGINT kill the workers and raise _Stopped;
    a second signal while the report is written is ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set in the main thread
        return

    def handler(signum: int, frame: Any) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        bench.stop()
        raise _Stopped(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def _phases(bench: _Bench, progress: _Progress, start: float) -> None:
    """Pre-compiling, then the timed runs."""
    args = bench.args
    # With --time-limit: pre-compiling may take up to 40% of it, and each workload a
    # fair share of what is left.
    end = start + args.time_limit if args.time_limit else None
    if args.precompile_jobs:
        warm_end = None if end is None else start + _PRECOMPILE_SHARE * (end - start)
        progress.cold = bench.precompile(progress.plan, args.precompile_jobs, warm_end)
    _timed_runs(bench, progress, end)
    progress.doc["env"] = bench.env


# The smallest value of each count option, and the options that must be finite and > 0.
_COUNTS = {"steps": 1, "warmup": 1, "jobs": 1, "limit": 1, "precompile_jobs": 0}
_POSITIVE = ("time_limit", "method_timeout", "workload_time")


def _check_arguments(args: argparse.Namespace) -> None:
    """Numbers, the device and --out, before any work (_Fail naming the option)."""
    for name, low in _COUNTS.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise _Fail(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    for name in _POSITIVE:
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise _Fail(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
    if args.device is not None:
        try:
            check_device(args.device)
        except ValueError as e:
            raise _Fail(str(e)) from None
    if not args.list:
        try:
            probe_writable(args.out, "--out")
        except FolderNotWritable as e:
            raise _Fail(str(e)) from None


def run_script_suite(suite: Suite, methods: list[Method], argv: list[str] | None = None) -> int:
    """The entry of a ``benchmarks/`` script with a suite of its own: registers it, then
    is one of its workers (``--worker ARGS``: `runner.main`) or runs `mirrorgrad bench`
    on it with ``argv``."""
    register(suite, methods)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return runner.main(argv[1:])
    parser = argparse.ArgumentParser(prog=suite.script.name, description=suite.description)
    add_arguments(parser)
    parser.set_defaults(suite=suite.name)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """`mirrorgrad bench`: errors of the user's making are one line and exit status 2
    (before any work); a file system that fails under a run, one line and 1."""
    try:
        _check_arguments(args)
        return _run(args)
    except _Fail as e:
        print(f"mirrorgrad bench: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        where = f" {e.filename}" if e.filename else ""
        print(f"mirrorgrad bench: cannot write{where}: {e.strerror or e}", file=sys.stderr)
        return 1
