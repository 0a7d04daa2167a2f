"""Elastic recovery (`--set recovery=on`): a daemon that dies or hangs is relaunched on its slot.

Stateless roles (reward, reference, cost): the calls that failed with the daemon are retried once,
after the replacement said hello. Stateful roles (actor, critic): every rank is relaunched, the
step fails, and hfrt.flows.trainer reloads the last checkpoint in place and redoes the steps after it.

Two halves. The supervisor (`Recovery.on_gone`) hears of every death from the controller, asks a
`Relauncher` (a launcher that can restart one daemon) for a new process, waits for its hello and
counts restarts; a daemon that keeps dying (more than `max_restarts` within `window_s`) ends the
run with RecoveryFailed naming it and its last log lines. The call layer (`Recovery.call`, used by
hfrt.control.group for every endpoint call once recovery is on) retries a call that failed because its
callee died, or because an argument handle was made by a daemon that has since been replaced: such
a handle is made again by re-running the call that produced it (its lineage, kept for calls to
stateless roles only, as long as the handle is alive). A call to a stateless role that runs past
its endpoint's deadline counts as a hang of its daemon; for a stateful role the same, and the
trainer's rewind follows. `on_restart(role, callback)` lets a flow bring a replacement up to date
before the failed calls are retried (e.g. push the actor's current weights to a new rollout daemon);
registering one makes `role` recoverable. It knows role names, launchers' relaunch and the
controller's registry; nothing of what endpoints compute, and no torch.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from hfrt.control.daemons import DaemonInfo, Registry
from hfrt.control.group import Delivery, EndpointRef, RoleGroup
from hfrt.log import get_logger
from hfrt.protocols import BatchHandle
from hfrt.wire import shm
from hfrt.wire.errors import DaemonGone, HfrtError, RemoteError

#: Calls of one endpoint that must have finished before its hang deadline applies; recent ones kept.
HANG_SAMPLES, RECENT = 3, 20
#: Roles whose daemons hold no state a step depends on beyond their options (model path, reward
#: function): safe to relaunch and retry. Not "rollout": a fresh rollout daemon samples with its
#: initial weights; it becomes recoverable once a flow registers `Recovery.on_restart("rollout", ...)`
#: to push it the current ones.
STATELESS = frozenset({"reward", "reference", "cost"})
#: A flow's hook for replacements (`Recovery.on_restart`): called with the identities replaced.
RestartHook = Callable[[list[str]], Awaitable[None]]


class RecoveryFailed(HfrtError):
    """A role could not be brought back (it kept dying, or its replacement never said hello)."""


class Relauncher(Protocol):
    """What recovery needs of a launcher (hfrt.deploy.launchers.base.Relauncher has the full contract)."""

    async def relaunch(self, identity: str) -> int: ...


#: What Relauncher.relaunch returns when it cannot know the new process's pid (a Slurm step):
#: recovery then accepts the first hello from a pid other than the dead daemon's. The same value
#: as hfrt.deploy.launchers.base.PID_UNKNOWN (the launchers' side of this contract).
PID_UNKNOWN = 0


@dataclass(frozen=True)
class RecoveryPolicy:
    """`--set recovery=on` and its limits (FlowConfig carries the keys; run.py builds this).

    max_restarts: restarts of one role allowed within window_s; one more ends the run.
    hello_timeout_s: how long a replacement may take to say hello (model load included).
    roles: the roles that are relaunched and whose failed calls are retried (default STATELESS).
    stateful: roles that are relaunched (every rank, when one dies: their process group is
        rebuilt) but not retried: the step fails, and hfrt.flows.trainer reloads the last
        checkpoint into every trained role and redoes the steps after it (see `lost_state`).
        Deaths of roles in neither set end the run.
    hang_factor / hang_floor_s: once an endpoint of a recoverable or stateful role has finished
        HANG_SAMPLES calls, a call to it that runs past max(hang_floor_s, hang_factor × the
        slowest of its recent calls) is treated as its daemon hanging: the daemon is declared gone
        and replaced (stateful: and the step fails into the trainer's rewind).
    """

    enabled: bool = False
    max_restarts: int = 3
    window_s: float = 600.0
    hello_timeout_s: float = 120.0
    roles: frozenset[str] = STATELESS
    stateful: frozenset[str] = frozenset({"actor", "critic"})
    hang_factor: float = 10.0
    hang_floor_s: float = 60.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RecoveryPolicy:
        """From a flow's config dict: recovery = "on" | "off" (or true/false), recovery_max_restarts,
        recovery_window_s; a bad value raises naming the key."""
        value = config.get("recovery", "off")
        if value not in ("on", "off", True, False):
            raise ValueError(f"config recovery={value!r}: use on or off")
        restarts = config.get("recovery_max_restarts", cls.max_restarts)
        window = config.get("recovery_window_s", cls.window_s)
        if not isinstance(restarts, int) or restarts < 0:
            raise ValueError(f"config recovery_max_restarts={restarts!r}: must be a whole number >= 0")
        if not isinstance(window, int | float) or window <= 0:
            raise ValueError(f"config recovery_window_s={window!r}: must be a positive number of seconds")
        return cls(value in ("on", True), restarts, float(window))


@dataclass(slots=True)
class _Recipe:
    """How a handle was made: the call to re-run, and the daemons that made it (the group's list
    when it was sent: a group is pointed at a new list, never changed in place, so keeping the
    list is a snapshot that costs nothing per rank)."""

    ref: EndpointRef
    how: Delivery
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    makers: list[DaemonInfo]


@dataclass(slots=True)
class RecoveryStats:
    restarts: int = 0  # daemon processes launched as replacements (one killed during start-up counts again)
    retried_calls: int = 0
    rewinds: int = 0  # checkpoint reloads after a stateful role was replaced
    lost_s: float = 0.0  # see Downtime (Recovery.metrics reads it live)
    replace_s: list[float] = field(default_factory=list)  # per restart: death → replacement ready (hello, hooks)


class Downtime:
    """Wall time during which any recovery was under way: a replacement (death → ready), a retried
    call (failure → retry's result) or a rewind (step failed → checkpoint reloaded). Windows that
    overlap (actor and reward killed together) count once, so the figure never exceeds wall time
    and is never smaller than the longest replacement."""

    def __init__(self) -> None:
        self._closed: list[tuple[float, float]] = []  # disjoint, sorted
        self._open: dict[int, float] = {}
        self._tokens = 0

    def begin(self, at: float | None = None) -> int:
        self._tokens += 1
        self._open[self._tokens] = time.monotonic() if at is None else at
        return self._tokens

    def end(self, token: int) -> None:
        start = self._open.pop(token, None)
        if start is not None:
            self.add(start, time.monotonic())

    def add(self, start: float, end: float) -> None:
        merged = [(start, end)]
        for a, b in self._closed:
            if b < merged[0][0] or a > merged[0][1]:
                merged.append((a, b))
            else:
                merged[0] = (min(a, merged[0][0]), max(b, merged[0][1]))
        self._closed = sorted(merged)

    def total(self) -> float:
        """Seconds covered by the windows so far (open ones up to now)."""
        now = time.monotonic()
        seconds, reach = 0.0, float("-inf")
        for a, b in sorted([*self._closed, *((start, now) for start in self._open.values())]):
            if b > reach:
                seconds += b - max(a, reach)
                reach = b
        return seconds


class Recovery:
    """The supervisor and the retry layer, for one controller; see the module docstring."""

    def __init__(self, launcher: Relauncher, policy: RecoveryPolicy) -> None:
        """Make the layer; the controller constructed with it (`Controller(..., recovery=r)`)
        attaches it to its registry."""
        self.launcher, self.policy = launcher, policy
        self.stats = RecoveryStats()
        self.downtime = Downtime()
        self.failure: RecoveryFailed | None = None
        self.closing = False
        self._replacing: dict[str, asyncio.Task[None]] = {}
        self._history: dict[str, deque[float]] = {}
        self._exits: dict[str, str] = {}
        self._lost: dict[str, str] = {}  # stateful daemons replaced since the last rewind → why
        self._recent: dict[tuple[str, str], deque[float]] = {}  # (role, endpoint) → recent durations
        self._lineage: dict[int, _Recipe] = {}  # id of a live handle → how it was made
        self.roles: set[str] = set(policy.roles)  # relaunched and retried (policy.roles + on_restart's)
        self._hooks: dict[str, list[RestartHook]] = {}
        self._outstanding: dict[str, int] = {}  # role → replacements in progress
        self._fresh: dict[str, list[str]] = {}  # role → identities replaced in this round (for hooks)
        self._groups: weakref.WeakSet[RoleGroup] = weakref.WeakSet()  # groups calls went through
        self._log = get_logger(part="recovery")

    def attach(self, registry: Registry) -> None:
        """Watch `registry` (the controller this layer was given to): hear of every death."""
        self.ctl = registry
        registry.gone_listeners.append(self.on_gone)

    # -- supervisor ----------------------------------------------------------------------------

    def on_restart(self, role: str, callback: RestartHook) -> None:
        """Await `callback(identities)` once the daemons of `role` being replaced have all said
        hello, before the calls that failed with them are retried (and before the trainer's
        rewind, for a stateful role). It gets the replaced identities; role groups of `role`
        already point at the replacements, and its calls go through the retry layer as usual.
        It must not wait for a call that failed with a replaced daemon (that call is retried only
        after the callbacks): one that does not finish within hello_timeout_s ends the run, named.
        Registering makes `role` recoverable (relaunched, failed calls retried) if it was not: a
        rollout role is safe to relaunch once such a hook pushes it the actor's current weights.
        A callback that raises ends the run with RecoveryFailed naming it."""
        self._hooks.setdefault(role, []).append(callback)
        if role not in self.policy.stateful:
            self.roles.add(role)

    def on_exit(self, identity: str, reason: str) -> None:
        """The launcher's exit callback: a process it started ended (old daemon or replacement)."""
        self._exits[identity] = reason
        self.ctl.mark_gone(identity, reason)
        self.ctl.notify_change()

    def on_gone(self, info: DaemonInfo, reason: str, expected: bool) -> None:
        """The controller declared `info` gone: relaunch it if its role is recoverable, and every
        other rank of its role too (their process group, if any, is broken with it)."""
        stateful = info.role in self.policy.stateful
        if expected or self.closing or info.identity in self._replacing or not (stateful or info.role in self.roles):
            return
        self._outstanding[info.role] = self._outstanding.get(info.role, 0) + 1
        task = asyncio.get_running_loop().create_task(self._replace(info, reason, self.downtime.begin()))
        self._replacing[info.identity] = task
        task.add_done_callback(lambda _: self._replacing.pop(info.identity, None))
        if stateful:
            self._lost[info.identity] = reason
        for peer in self.ctl.daemons(info.role):
            if peer.alive:
                self.ctl.mark_gone(peer.identity, f"restarted with {info.identity}")

    async def _eventually(self, ready: Callable[[], bool]) -> bool:
        """Whether `ready()` holds now or within two heartbeat intervals: a call can fail through a
        peer's death (a broken collective, a pull from a killed owner) before that death has been
        reported, and the controller promises to report one within two intervals."""
        deadline = time.monotonic() + 2 * self.ctl.heartbeat_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0 or self.closing:
                return False
            await self.ctl.wait_change(left)
        return True

    async def wait_lost_state(self) -> dict[str, str]:
        """lost_state(), waiting up to two heartbeat intervals for a death to be reported (called
        when a step failed: a broken collective can fail it before its cause is reported)."""
        await self._eventually(lambda: bool(self._lost))
        return self.lost_state()

    def lost_state(self) -> dict[str, str]:
        """The stateful daemons replaced since the last `rewound()` (identity → why): when any,
        the trained roles must reload a checkpoint before the run goes on."""
        return dict(self._lost)

    def rewound(self, lost_s: float) -> None:
        """The trainer reloaded a checkpoint into every trained role, `lost_s` after the step failed
        (the steps it redoes are not counted)."""
        self._lost.clear()
        self.stats.rewinds += 1
        now = time.monotonic()
        self.downtime.add(now - lost_s, now)

    async def settle(self, groups: list[RoleGroup]) -> None:
        """Wait for every replacement in progress (raising RecoveryFailed if one failed), then
        point each of `groups` at its role's live daemons."""
        for group in groups:
            await self._settle(group)

    async def _replace(self, info: DaemonInfo, reason: str, window: int) -> None:
        try:
            await self._replace_in(info, reason)
        finally:
            self.downtime.end(window)

    async def _replace_in(self, info: DaemonInfo, reason: str) -> None:
        identity, role, died = info.identity, info.role, time.monotonic()
        old_pid, old_host = info.pid, str(info.meta.get("host", ""))
        try:
            while self.failure is None and not self.closing:
                if not self._within_limits(role, identity, reason):
                    return
                try:
                    self._exits.pop(identity, None)
                    pid = await self.launcher.relaunch(identity)
                    self.stats.restarts += 1  # each launch counts, also one that dies before its hello
                    shm.remove_files_of(old_pid, old_host)  # the old process is gone now (this host only)
                    failed = await self._await_hello(identity, pid, old_pid)
                except Exception as exc:  # a launcher that cannot relaunch ends the run, named
                    self._fail(f"{identity}: relaunch failed: {type(exc).__name__}: {exc}")
                    return
                if failed is None:
                    self._fresh.setdefault(role, []).append(identity)
                    break
                reason = failed
        finally:
            self._outstanding[role] -= 1
        if self._outstanding[role] == 0 and self.failure is None and not self.closing:  # the role's last: hooks
            replaced = self._fresh.pop(role, [])
            await self._run_hooks(role, replaced)
            if self.failure is None:
                self.stats.replace_s += [time.monotonic() - died] * len(replaced)
                self._log.warning("daemon_replaced", daemons=replaced, after_s=round(time.monotonic() - died, 2))

    async def _run_hooks(self, role: str, replaced: list[str]) -> None:
        if not replaced or not self._hooks.get(role):
            return
        for group in list(self._groups):
            if group.name == role:
                group.refresh([self.ctl.daemon(d.identity) or d for d in group.daemons])
        for hook in self._hooks[role]:
            name = getattr(hook, "__qualname__", repr(hook))
            try:
                await asyncio.wait_for(hook(replaced), self.policy.hello_timeout_s)
            except TimeoutError:
                self._fail(f"{', '.join(replaced)}: on_restart callback {name} did not finish within "
                           f"{self.policy.hello_timeout_s:.0f}s (does it wait for a call that failed with the replaced "
                           "daemon? such calls are retried only after the callbacks)")
                return
            except Exception as exc:
                self._fail(f"{', '.join(replaced)}: on_restart callback {name} failed: {type(exc).__name__}: {exc}")
                return

    def _within_limits(self, role: str, identity: str, reason: str) -> bool:
        now = time.monotonic()
        history = self._history.setdefault(identity, deque())
        while history and now - history[0] > self.policy.window_s:
            history.popleft()
        if len(history) >= self.policy.max_restarts:
            self._fail(
                f"role {role!r} keeps dying: {identity} restarted {len(history)} times within {self.policy.window_s:.0f}s "
                f"(recovery_max_restarts={self.policy.max_restarts}); last exit: {reason}"
            )
            return False
        history.append(now)
        return True

    async def _await_hello(self, identity: str, pid: int, old_pid: int) -> str | None:
        """None once process `pid` (PID_UNKNOWN: any but `old_pid`) said hello as `identity`;
        else why not (it exited, or timed out)."""
        deadline = time.monotonic() + self.policy.hello_timeout_s
        while True:
            info = self.ctl.daemon(identity)
            if info is not None and info.alive and (info.pid == pid or (pid == PID_UNKNOWN and info.pid != old_pid)):
                return None
            if identity in self._exits:
                return self._exits.pop(identity)
            left = deadline - time.monotonic()
            if left <= 0:
                return f"replacement pid {pid} did not say hello within {self.policy.hello_timeout_s:.0f}s"
            await self.ctl.wait_change(left)

    def _fail(self, message: str) -> None:
        self.failure = RecoveryFailed(message)
        self._log.error("recovery_failed", error=message)
        self.ctl.notify_change()

    # -- call layer ----------------------------------------------------------------------------

    def call(self, ref: EndpointRef, how: Delivery, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        """Send the call now (as the group would without recovery) and return a task for its result:
        if it failed with a daemon that recovery replaces, or read a handle such a daemon made, the
        task waits for the replacement, remakes stale handles, and sends it once more."""
        self._groups.add(ref.group)
        how = self._deadline(ref, how)
        first, sent = ref.resend_now(how, args, kwargs), time.monotonic()
        task = asyncio.ensure_future(self._finish(ref, how, args, kwargs, first, sent))
        task.add_done_callback(lambda t: first.cancel() if t.cancelled() else None)  # cancelled before it ran
        return task

    async def _finish(self, ref: EndpointRef, how: Delivery, args: tuple[Any, ...], kwargs: dict[str, Any],
                      first: asyncio.Future[Any], sent: float) -> Any:
        makers = ref.group.daemons
        try:
            result = await first
        except (DaemonGone, RemoteError) as exc:
            if ref.group.name in self.policy.stateful and any(not d.alive for d in ref.group.daemons):
                raise  # its own daemon died or hung: no retry, the step fails into the trainer's rewind now
            if not await self._eventually(lambda: self._retryable(ref.group, args, kwargs)):
                raise
            window = self.downtime.begin()
            self._log.warning("call_retried", call=f"{ref.group.name}.{ref.name}", error=str(exc).splitlines()[0])
            try:
                await self._settle(ref.group)
                args, kwargs = await self._remade(args, kwargs)
                makers, sent = ref.group.daemons, time.monotonic()
                result = await ref.resend_now(how, args, kwargs)
            finally:
                self.downtime.end(window)
            self.stats.retried_calls += 1
        self._recent.setdefault((ref.group.name, ref.name), deque(maxlen=RECENT)).append(time.monotonic() - sent)
        if ref.group.name in self.roles and isinstance(result, BatchHandle):
            self._lineage[id(result)] = _Recipe(ref, how, args, kwargs, makers)
            weakref.finalize(result, self._lineage.pop, id(result), None)  # forgotten with the handle
        return result

    def _deadline(self, ref: EndpointRef, how: Delivery) -> Delivery:
        """`how` with its timeout lowered to the endpoint's hang deadline, for a recoverable or
        stateful role whose endpoint has finished HANG_SAMPLES calls."""
        recent = self._recent.get((ref.group.name, ref.name), ())
        if not self._watched(ref.group.name) or len(recent) < HANG_SAMPLES:
            return how
        deadline = max(self.policy.hang_floor_s, self.policy.hang_factor * max(recent))
        return how.with_deadline(deadline)

    def hung(self, info: DaemonInfo) -> bool:
        """Whether a call to `info` that timed out means its daemon hangs (the controller then
        declares it gone, which replaces it and retries the call, rather than raise CallTimeout)."""
        return self._watched(info.role) and not self.closing

    def _watched(self, role: str) -> bool:
        return role in self.roles or role in self.policy.stateful

    def _retryable(self, group: RoleGroup, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        callee_replaced = group.name in self.roles and any(not d.alive for d in group.daemons)
        return callee_replaced or any(self._stale(h) for h in _handles(args, kwargs))

    def _stale(self, handle: BatchHandle) -> bool:
        recipe = self._lineage.get(id(handle))
        if recipe is None:
            return False
        for maker in recipe.makers:
            info = self.ctl.daemon(maker.identity)
            if info is None or not info.alive or info.pid != maker.pid:
                return True
        return False

    async def _settle(self, group: RoleGroup) -> None:
        """Wait until every daemon recovery is replacing has said hello (or recovery failed), then
        point `group` at its role's live daemons. (An on_restart hook's own calls do not wait
        for the replacement that runs the hook.)"""
        current = asyncio.current_task()
        while waiting := [t for t in self._replacing.values() if t is not current]:
            await asyncio.gather(*waiting, return_exceptions=True)
        if self.failure is not None:
            raise self.failure
        group.refresh([self.ctl.daemon(d.identity) or d for d in group.daemons])
        if any(not d.alive for d in group.daemons):
            raise DaemonGone(f"role {group.name!r}: {', '.join(d.describe() for d in group.daemons if not d.alive)} "
                             "gone and not being replaced")

    async def _remade(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments with every stale handle made again by re-running its recipe."""
        fresh: dict[int, BatchHandle] = {}
        for handle in _handles(args, kwargs):
            if id(handle) not in fresh and self._stale(handle):
                recipe = self._lineage[id(handle)]
                await self._settle(recipe.ref.group)
                fresh[id(handle)] = await recipe.ref.resend(recipe.how, recipe.args, recipe.kwargs)
        swap = lambda v: fresh.get(id(v), v)  # noqa: E731
        return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}

    def metrics(self) -> dict[str, float]:
        """Cumulative figures for a step's metrics record (lost_s: see Downtime)."""
        self.stats.lost_s = self.downtime.total()
        return {"recovery/restarts": self.stats.restarts, "recovery/lost_s": round(self.stats.lost_s, 3),
                "recovery/retried_calls": self.stats.retried_calls, "recovery/rewinds": self.stats.rewinds}

    async def close(self) -> None:
        """Stop relaunching (the run is ending) and wait for relaunches in progress to settle."""
        self.closing = True
        tasks = list(self._replacing.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _handles(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[BatchHandle]:
    """The batch handles among a call's top-level arguments (where flows pass them)."""
    return [v for v in (*args, *kwargs.values()) if isinstance(v, BatchHandle)]
