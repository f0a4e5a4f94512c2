"""Stopping child processes: the one way the stages end what they started.

A stop asks first and forces second: SIGCONT (a stopped process cannot run a SIGTERM handler,
such as our endpoint servers' shutdown), SIGTERM, one grace period shared by all of them, then
SIGKILL for whatever is left. With `group=True` the signals go to each child's process group
(children started with `start_new_session=True`), so helpers the child started end with it, and
the stop waits for every member, not just the child: a wrapper such as `dvc repro` dies on
SIGTERM at once while the stage it ran is still saving its work. A group is signalled only while
it has live members (Linux keeps its id from being reused until then).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

KILL_WAIT_S = 5.0
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child, before exec (`preexec_fn`): get SIGTERM if the parent dies, even of SIGKILL,
    which runs no cleanup of ours. Linux only; elsewhere group stops are all there is."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def adopt_niceness() -> None:
    """In a process that leads a session of its own (started with `start_new_session=True`):
    give the session's autogroup this process's niceness. Under autogroup scheduling (Linux's
    `sched_autogroup_enabled`, on here) the CPU is shared between sessions before niceness is
    looked at, so a `nice -n 19` extraction's producers, each in a new session, took half of
    both cores from a nice-0 measurement beside them. Raising an autogroup's nice needs no
    privilege; where there is no autogroup this does nothing."""
    if os.getsid(0) != os.getpid():
        return  # in the caller's session: its autogroup is the caller's to set
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(str(os.nice(0)))


def _signal(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        proc.send_signal(sig)  # a no-op once the process is reaped


def _wait_all(procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if state != "Z" and int(pgrp) == pgid:
            members.append(int(stat.parent.name))
    return members


def _stop_groups(leaders: list[subprocess.Popen], grace: float) -> list[subprocess.Popen]:
    for p in leaders:
        p.poll()
    live = [p.pid for p in leaders if group_members(p.pid)]
    for pgid, sig in ((g, s) for g in live for s in (signal.SIGCONT, signal.SIGTERM)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for seconds, then in ((grace, signal.SIGKILL), (KILL_WAIT_S, None)):
        deadline = time.monotonic() + seconds
        while live and time.monotonic() < deadline:
            time.sleep(0.05)
            for p in leaders:
                p.poll()  # a leader is a member until reaped
            live = [g for g in live if group_members(g)]
        for pgid in live if then else ():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, then)
    # A multithreaded leader shows as a zombie while its other threads still exit, and cannot
    # be reaped until they have: wait for the leaders of emptied groups, not only poll them.
    _wait_all([p for p in leaders if p.pid not in live], KILL_WAIT_S)
    return [p for p in leaders if p.pid in live]


def stop_processes(
    procs: Iterable[subprocess.Popen], *, grace: float = 10.0, group: bool = False
) -> list[subprocess.Popen]:
    """End and reap every process in `procs` (with `group`, every member of their groups), in
    at most grace + KILL_WAIT_S seconds however many there are. Processes that already exited
    are only reaped.

    Returns the ones still running after SIGKILL (a process stuck in the kernel: rare, and
    nothing more can be done from here); normally empty.
    """
    if group:
        return _stop_groups(list(procs), grace)
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal(p, signal.SIGCONT)
        _signal(p, signal.SIGTERM)
    _wait_all(running, grace)
    stubborn = [p for p in running if p.poll() is None]
    for p in stubborn:
        _signal(p, signal.SIGKILL)
    _wait_all(stubborn, KILL_WAIT_S)
    return [p for p in stubborn if p.poll() is None]


# --- A whole tree: a supervisor's child and whatever it started, in any session ------------

TREE_ENV = "DSPARK_TREE"  # marks (space-separated) of the supervised trees a process is in
SETTLE_S = 10.0


def with_mark(env: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """`env` (default: ours) plus a new tree mark, and the mark. Children inherit their
    environment, so every process started below, in whatever session or group it made for
    itself and even once orphaned, carries it in /proc/<pid>/environ."""
    base = dict(os.environ if env is None else env)
    mark = f"{os.getpid()}.{time.monotonic_ns()}"
    base[TREE_ENV] = f"{base.get(TREE_ENV, '')} {mark}".strip()
    return base, mark


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _marks(pid: int) -> list[str]:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return []  # gone meanwhile, or not ours
    key = f"{TREE_ENV}=".encode()
    value = next((e[len(key) :] for e in env.split(b"\0") if e.startswith(key)), b"")
    return value.decode(errors="replace").split()


def marked(mark: str) -> list[int]:
    """The live processes (not this one) that carry `mark` (`with_mark`): of those this user
    may read the environment of, which is every one this user started."""
    pids = (int(d.name) for d in Path("/proc").glob("[0-9]*"))
    return [p for p in pids if p != os.getpid() and mark in _marks(p) and alive(p)]


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue
        if state != "Z" and int(ppid) == pid:
            out.append(int(stat.parent.name))
    return out


def signal_leader(pid: int, sig: int) -> None:
    """`sig` to the group `pid` leads (all of it), or to `pid` alone if it leads none."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def _wait_for(done, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def supervise(
    argv: list[str],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    grace: float,
    ask: int = signal.SIGTERM,
    settle: float = SETTLE_S,
    say: Callable[[str], None] = print,
) -> int:
    """Run `argv` (a service that runs jobs as its children, like a Prefect worker) until it
    exits or this process gets SIGTERM, SIGINT or SIGHUP; then stop every process it started,
    in whatever session each one made for itself, in at most grace + settle + KILL_WAIT_S.

    The stop asks first: `ask` to the service's group (a worker then takes no new job) and
    SIGTERM to each of its children's groups (its jobs: each stops as a cancelled one would,
    saving what resumes it), one signal each. Once the jobs are gone (or after `grace`), the
    service gets `settle` seconds to follow. Then SIGKILL for every process still carrying
    the tree's mark; at once on a second signal. Runs on the main thread (it installs signal
    handlers).

    Says (`say`) what it asked, and what it had to kill.

    Returns 0 when stopped by a signal, else the service's exit status.
    """
    env, mark = with_mark(env)
    service = subprocess.Popen(
        argv, cwd=cwd, env=env, start_new_session=True, preexec_fn=die_with_parent
    )
    asked: list[int] = []
    previous = {}

    def on_signal(signum, _frame):
        asked.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        while service.poll() is None and not asked:
            with contextlib.suppress(subprocess.TimeoutExpired):
                service.wait(0.2)
    finally:
        if service.poll() is None:
            jobs = set(children(service.pid))
            signal_leader(service.pid, signal.SIGCONT)
            signal_leader(service.pid, ask)
            jobs |= set(children(service.pid))  # one it started meanwhile
        else:  # it died: whatever it left is orphaned, and asked all the same
            jobs = marked(mark)
        for pid in jobs:
            signal_leader(pid, signal.SIGCONT)
            signal_leader(pid, signal.SIGTERM)
        t0 = time.monotonic()
        why = f"on {signal.Signals(asked[0]).name}" if asked else "after the service exited"
        say(f"stopping {len(marked(mark))} processes {why}: {len(jobs)} job(s) asked to stop")
        impatient = lambda: len(asked) > 1  # noqa: E731 - a second signal: kill now
        _wait_for(lambda: impatient() or set(marked(mark)) <= {service.pid}, grace)
        _wait_for(lambda: impatient() or service.poll() is not None, settle)
        left = marked(mark)
        if left:
            say(f"killing {len(left)} processes still running after {time.monotonic() - t0:.0f} s")
        for _ in range(int(KILL_WAIT_S / 0.1)):
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            service.poll()
            time.sleep(0.1)
            left = marked(mark)
        with contextlib.suppress(subprocess.TimeoutExpired):
            service.wait(KILL_WAIT_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        say(f"stopped in {time.monotonic() - t0:.1f} s")
    return 0 if asked else service.returncode
