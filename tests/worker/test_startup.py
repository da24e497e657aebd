"""The startup stages: counted from the worker process's start, every stage named, adding up to the
time a client waits for readiness (a real worker process, measured from outside)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from worker_harness import GRAPHKEEPER, start_worker, wait_serving

from graphkeeper.worker.engine import startup
from graphkeeper.worker.engine.client import merge_families
from graphkeeper.worker.engine.startup import StartupClock, caches, finish, line, step_parts
from graphkeeper.worker.metrics import STARTUP_STAGES, WorkerMetrics
from graphkeeper.worker.model.step import CompileReport
from graphkeeper.worker.model.tuning import TuningReport

#: What may lie between the worker serving and a readiness poll seeing it (the poll interval, a
#: busy API process answering it), and between /readyz answering 200 and the gRPC servers
#: listening, on a loaded two-core machine.
SLACK_SECONDS = 1.5


def wait_ready(worker, timeout: float = 120.0) -> float:
    """Polls /readyz (a new HTTP connection each time: no reconnect backoff, unlike a gRPC channel
    that failed to connect) until 200; returns the wall-clock time it first answered 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"worker exited with {worker.proc.returncode}:\n{worker.log()}")
        try:
            if worker.http_get("/readyz")[0] == 200:
                return time.time()
        except OSError:  # the metrics port is not bound yet
            pass
        time.sleep(0.02)
    raise TimeoutError(f"worker not ready after {timeout} s:\n{worker.log()}")


def started_at(pid: int) -> float:
    """A process's start on the wall clock, read from outside it (/proc)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc to read a process's start")
@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_the_stages_add_up_to_the_time_from_the_process_start_to_ready(tmp_path, engine_process):
    before = time.time()
    worker = start_worker(tmp_path, *(() if engine_process else ("--no-engine-process",)), wait=False)
    try:
        begun = started_at(worker.proc.pid)
        waited = wait_ready(worker) - begun  # what a client polling readiness saw, from the process's start
        wait_serving(worker)
        startup = worker.status().startup
        metrics = worker.metrics()
        token = next(tmp_path.glob("token-*"))
        shown = subprocess.run([str(GRAPHKEEPER), "status", "--target", worker.target, "--control-target",
                                worker.control_target, "--token-file", str(token)],
                               capture_output=True, text=True, timeout=60)
        log = worker.log()
    finally:
        worker.stop()
    assert begun >= before - 0.05  # the start read from /proc is this process's
    names = [s.stage for s in startup.stages]
    # Every stage, in order; with the engine on a thread of the worker process, no engine process.
    assert names == [n for n in STARTUP_STAGES if engine_process or n != "engine_process"]
    assert all(s.seconds >= 0 for s in startup.stages)
    total = sum(s.seconds for s in startup.stages)
    assert total == pytest.approx(startup.ready_seconds, abs=1e-6)
    # Counted from the worker process's start (not the engine core's): within the readiness
    # poll's slack of what the client measured.
    assert startup.started_unix_seconds == pytest.approx(begun, abs=0.05)
    assert startup.ready_seconds == pytest.approx(waited, abs=SLACK_SECONDS)
    assert startup.stages[0].seconds > 0 and startup.stages[1].seconds > 0  # the imports, of both processes
    assert (startup.compile_cache, startup.tuning_cache, startup.caches) == ("off", "off", "none")  # a CPU
    for stage in startup.stages:  # the metric carries the same stages (a stage not had: 0)
        assert metrics[("graphkeeper_startup_stage_seconds", frozenset({("stage", stage.stage)}))] == pytest.approx(
            stage.seconds, abs=1e-3)
    assert metrics[("graphkeeper_startup_cache", frozenset({("cache", "compile"), ("outcome", "off")}))] == 1
    assert metrics[("graphkeeper_startup_cache", frozenset({("cache", "tuning"), ("outcome", "miss")}))] == 0
    assert f"READY {startup.ready_seconds:.1f} s after the worker process started" in log
    assert "startup: before_engine " in log
    assert shown.returncode == 0, shown.stderr
    assert f"startup   READY {startup.ready_seconds:.1f} s after the process started, caches none" in shown.stdout


def test_the_clock_counts_from_the_worker_process_and_splits_measured_parts():
    now = time.time()
    clock = StartupClock(process_started=now - 3.0, engine_spawned=now - 1.0)
    assert [name for name, _ in clock.stages] == ["before_engine", "engine_process"]
    assert clock.stages[0][1] == pytest.approx(2.0, abs=0.01)
    assert clock.stages[1][1] == pytest.approx(1.0, abs=0.1)
    clock.split("warm_up", {"kernel_tuning": 0.0, "compile": 10.0})  # more than elapsed: capped at it
    status = clock.status("hit", "hit")
    assert [s.stage for s in status.stages][2:] == ["kernel_tuning", "compile", "warm_up"]
    assert status.stages[4].seconds == 0.0
    assert sum(s.seconds for s in status.stages) == pytest.approx(status.ready_seconds)
    assert status.caches == "warm"
    done = finish(status, status.started_unix_seconds + status.ready_seconds + 0.5)
    assert done.stages[-1].stage == "ready" and done.stages[-1].seconds == pytest.approx(0.5)
    assert sum(s.seconds for s in done.stages) == pytest.approx(done.ready_seconds)
    assert "READY" in line(done) and "caches warm" in line(done)


def test_an_engine_in_the_worker_process_has_no_engine_process_stage():
    clock = StartupClock(process_started=time.time() - 1.0)
    assert [name for name, _ in clock.stages] == ["before_engine"]
    assert [name for name, _ in StartupClock().stages] == []  # an engine built alone counts from itself


def test_a_start_is_warm_only_when_every_cache_it_used_hit():
    assert caches("hit", "hit") == "warm"
    assert caches("off", "hit") == "warm"
    assert caches("partial", "hit") == "cold"
    assert caches("hit", "miss") == "cold"
    assert caches("off", "off") == "none"


def test_step_parts_are_tuning_and_compile_seconds():
    report = CompileReport(enabled=True, seconds=2.0, tuning=TuningReport(cache="hit", seconds=0.5))
    assert step_parts(report) == {"kernel_tuning": 0.5, "compile": 2.0}
    assert step_parts(CompileReport()) == {"kernel_tuning": 0.0, "compile": 0.0}



def test_the_exposition_takes_the_startup_stages_from_the_api_process():
    """Gauges are the engine core's, except a family it has no sample of: the stages only the API
    process can finish."""
    core, api = WorkerMetrics(), WorkerMetrics()
    core.queue_depth.set(3)
    api.queue_depth.set(7)  # the engine core's gauge wins
    api.set_startup(finish(StartupClock(time.time() - 2.0).status("hit", "miss"), time.time()))
    merged = {f.name: f for f in merge_families(list(core.registry.collect()), list(api.registry.collect()))}
    assert [s.value for s in merged["graphkeeper_queue_depth"].samples] == [3]
    stages = {s.labels["stage"]: s.value for s in merged["graphkeeper_startup_stage_seconds"].samples}
    assert set(stages) == set(STARTUP_STAGES) and stages["before_engine"] >= 1.9
    caches = {(s.labels["cache"], s.labels["outcome"]): s.value for s in merged["graphkeeper_startup_cache"].samples}
    assert caches[("compile", "hit")] == 1 and caches[("tuning", "miss")] == 1 and caches[("tuning", "hit")] == 0


def test_the_capture_stage_is_split_into_the_capture_jobs_parts():
    from graphkeeper.worker.executor.graphs.capture import CAPTURE_PARTS as JOB_PARTS

    assert startup.CAPTURE_PARTS == JOB_PARTS
    parts = startup.capture_parts({"prime": 1.0, "record": 2.5})
    assert list(parts) == [f"capture_{p}" for p in JOB_PARTS]
    assert (parts["capture_prime"], parts["capture_record"], parts["capture_setup"]) == (1.0, 2.5, 0.0)
    assert [n for n in STARTUP_STAGES if n.startswith("capture_")] == [*parts, "capture_other"]
