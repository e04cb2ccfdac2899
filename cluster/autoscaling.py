"""Consolidation-aware autoscaling for LoraReplica (Punica: replicas are full or given back).

Each replica pushes `record_autoscaling_stats()` (running, waiting, max batch, KV blocks,
idle_since, draining) to the Serve controller every `metrics_interval_s`; the controller
calls this policy every 0.1 s with those reports (`ctx.raw_metrics`, the latest sample of
each replica), the running replicas in the order Serve started them (`ctx.running_replicas`)
and the requests queued at the handles, waiting in the router for a replica with room
(`ctx.total_queued_requests`).

Demand is counted in replicas: each replica's share of its batch or of its KV blocks,
whichever is larger, plus the requests waiting for room over one replica's batch. The
policy keeps a short history of it in `state`. Decisions (`decide`, a pure function):
- up, when requests have waited for room for `upscale_delay_s`: by as many replicas as
  that work needs (⌈waiting / max batch⌉, less those already starting), within max_replicas;
- up, when the demand expected `upscale_lead_s` ahead (now plus its rise over
  `trend_window_s`: the smaller slope of the window's two halves, so a step is no trend; at
  most one replica's worth) would fill the replicas above `high_water`, plus `min_idle_replicas` warm spares, for
  `upscale_delay_s`: room before it is needed, since a replica takes seconds (CPU) to a
  minute (GPU) to start;
- down, only by the newest replicas (the ones Ray stops) that have held no request for
  `downscale_delay_s` (counted from the policy's first sight of each), only while the demand of
  that whole window fits the rest and no request was queued in the look-back window; to zero
  through one (Ray scales to zero only from one replica);
- otherwise hold. Every change is logged with its reason and counted in metrics.

Which replicas go is Ray's choice: `deployment_scheduler._get_replicas_to_stop` stops
replicas not running yet first, then those on the nodes with the fewest replicas, and on a
node the newest first — the newest by the order they became running, which is the order of
`ctx.running_replicas` and of the replica list the router gets. The router
(cluster/router.py) feeds the newest replica only when no other has room, so it is the one
that empties as load falls; the policy releases it once it has been idle for the delay and
never releases an idle replica behind a busy newer one (Ray would stop the busy one). A
release that still cut a request (one routed to it after its last report) shows in the
router's `loraplex_autoscaler_busy_releases` counter.

The delays are applied here, per replica and per waiting request, so `ray_autoscaling
_config` hands them to the policy and sets Ray's own delay timer (which counts consecutive
decisions on top) to 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICY_PATH = "cluster.serve_policy:ConsolidatingPolicy"  # decide() wired to Serve's AutoscalingContext
DEFAULTS = {"upscale_delay_s": 1.0, "downscale_delay_s": 30.0, "metrics_interval_s": 1.0, "look_back_period_s": 3.0}
POLICY_KEYS = ("high_water", "min_idle_replicas", "trend_window_s", "upscale_lead_s")


@dataclass(frozen=True)
class PolicyConfig:
    upscale_delay_s: float = 1.0
    downscale_delay_s: float = 30.0
    # share of a replica's batch or KV the demand may fill before another replica is asked for:
    # below 1, so the next one starts while the last quarter of the batches fills
    high_water: float = 0.75
    release_grace_s: float = 10.0  # a released replica Serve still lists as running is not counted again
    min_idle_replicas: int = 0  # warm spares beyond the demand (replica-seconds for tail latency)
    trend_window_s: float = 20.0  # the demand's slope is fitted over this window
    upscale_lead_s: float = 10.0  # how far ahead the trend is followed: about a replica's start time
    max_batch: int = 1  # one replica's batch until a report says (the deployment's max_batch_size)


@dataclass(frozen=True)
class ReplicaLoad:
    replica: str
    running: int
    waiting: int
    max_batch: int
    free_kv_blocks: int
    total_kv_blocks: int
    idle_since: float  # wall time the replica's last request left; 0 while it holds one
    draining: bool
    started_at: float = 0.0

    @classmethod
    def from_report(cls, replica: str, r: dict[str, float]) -> ReplicaLoad:
        return cls(
            replica,
            int(r["running"]),
            int(r["waiting"]),
            int(r["max_batch"]),
            int(r["free_kv_blocks"]),
            int(r["total_kv_blocks"]),
            float(r["idle_since"]),
            bool(r.get("draining", 0)),
            float(r.get("started_at", 0.0)),
        )

    def share(self) -> float:
        """How much of one replica this one's load takes: batch or KV, whichever is fuller."""
        if self.running + self.waiting == 0:
            return 0.0
        used_kv = self.total_kv_blocks - self.free_kv_blocks
        return max((self.running + self.waiting) / max(1, self.max_batch), used_kv / max(1, self.total_kv_blocks))

    def full(self, high_water: float) -> bool:
        used_kv = self.total_kv_blocks - self.free_kv_blocks
        return self.running >= high_water * self.max_batch or used_kv >= high_water * self.total_kv_blocks

    def idle_for(self, now: float) -> float:
        return now - self.idle_since if self.idle_since > 0 and self.running == self.waiting == 0 else 0.0


@dataclass(frozen=True)
class Decision:
    target: int
    reason: str  # cold_start | queue | high_water | trend | spare | idle | hold
    detail: str
    going: tuple[str, ...] = ()  # the replicas Ray will stop, newest first


def decide(
    now: float,
    target: int,
    current: int,
    loads: list[ReplicaLoad],
    queued: float,
    min_replicas: int,
    max_replicas: int,
    cfg: PolicyConfig,
    state: dict,
    unreported: int = 0,
) -> Decision:
    """The target replica count. ``loads``: the running replicas that reported, oldest first
    in Serve's order (Ray stops the last first). ``state`` (mutated) keeps when waiting and a
    shortfall began, the demand's recent history, and which replicas were released when.
    ``unreported``: running replicas with no report yet (just started: the newest, with room)."""
    seen = _first_seen(state, loads, now)  # every call: a replica is seen from its first report
    live = [r for r in loads if not r.draining]
    # Requests queued at the router count only beyond the room the replicas report (the router
    # may hold a request a moment on a stale report); queued is Ray's mean over
    # look_back_period_s, so a request that waited less than half of it is no queue. An
    # engine's waiting requests count when its batch or KV is full: with room they are just
    # requests that arrived since its last step.
    max_batch = max((r.max_batch for r in live), default=cfg.max_batch)
    # a replica that runs but has not reported yet has just started: its whole batch is room
    room = sum(max(0, r.max_batch - r.running - r.waiting) for r in live) + unreported * max_batch
    held = math.floor(queued + 0.5)
    waiting = max(0, held - room) + sum(
        r.waiting if r.full(cfg.high_water) else max(0, r.running + r.waiting - r.max_batch) for r in live
    )
    starting = max(0, target - current) + unreported  # replicas about to take work
    waited = _since(state, "waiting_since", waiting > 0, now)
    if current == 0 and target == 0:
        # no report yet says how much one replica holds: start one, the queue rule adds the rest
        return (
            Decision(1, "cold_start", f"{queued:.1f} waiting, no replica")
            if queued > 0
            else Decision(0, "hold", "no replica, no request")
        )
    need = math.ceil(waiting / max_batch) if waiting > 0 else 0
    if waiting > 0 and waited >= cfg.upscale_delay_s and need > starting:
        new = min(max_replicas, max(target, current + need))
        if new > target:
            return Decision(
                new, "queue", f"{waiting:.1f} requests waited {waited:.1f}s for room, {starting} replica(s) starting"
            )
    demand = sum(r.share() for r in live) + waiting / max_batch
    level, wanted = _wanted(now, demand, cfg, state)
    serving = target - (len(loads) - len(live))  # draining replicas hold no new work
    short_for = _since(state, "short_since", wanted > serving, now)
    if wanted > serving and short_for >= cfg.upscale_delay_s and target < max_replicas:
        why = "high_water" if level > serving else "trend" if wanted - cfg.min_idle_replicas > serving else "spare"
        return Decision(
            min(max_replicas, target + wanted - serving),
            why,
            f"demand {demand:.2f} replicas wants {wanted} ({level} now at {cfg.high_water:.0%}), {serving} serving",
        )
    # any request queued in the look-back window (not only a rounded one) holds a release: it
    # waits for a replica, maybe one that has just started and reported idle before it came
    if queued > 0 or waiting or current != target or unreported:
        return Decision(target, "hold", "busy or replicas starting/stopping")
    floor = max(min_replicas, _recent_peak(now, cfg, state))
    return _release_idle(now, target, live, floor, cfg, state, seen)


def _first_seen(state: dict, loads: list[ReplicaLoad], now: float) -> dict[str, float]:
    """When the policy first saw each replica report. A new replica's idle clock starts at its
    construction, and the requests it was started for reach it only after Serve lists it as
    running and the handles learn of it (seconds under load): its idle time counts from here.
    Replicas already there at the policy's first call count as seen long ago."""
    before = state.get("seen")
    seen = {r.replica: (before or {}).get(r.replica, now if before is not None else 0.0) for r in loads}
    state["seen"] = seen
    return seen


def idle_for(r: ReplicaLoad, now: float, seen: dict[str, float]) -> float:
    """How long ``r`` has held nothing, counted from no earlier than the policy first saw it."""
    return min(r.idle_for(now), now - seen.get(r.replica, now))


def _wanted(now: float, demand: float, cfg: PolicyConfig, state: dict) -> tuple[int, int]:
    """Replicas the demand fills to `high_water` now, and those it wants: `upscale_lead_s`
    ahead on its trend, plus the warm spares. Records the demand and the answer in ``state``."""
    history = [(t, d) for t, d in state.get("demand") or () if now - t <= cfg.trend_window_s] + [(now, demand)]
    state["demand"] = history
    # at most one replica ahead: the slope of a few seconds of Poisson load is noisy, and every
    # replica started on it and not used is released again after the delay (its start is paid)
    ahead = demand + min(cfg.high_water, max(0.0, _slope(history, cfg.trend_window_s)) * cfg.upscale_lead_s)
    wanted = _replicas(ahead, cfg) + cfg.min_idle_replicas
    state["wanted"] = [(t, w) for t, w in state.get("wanted") or () if now - t <= cfg.downscale_delay_s]
    state["wanted"].append((now, wanted))
    return _replicas(demand, cfg), wanted


def _replicas(demand: float, cfg: PolicyConfig) -> int:
    return math.ceil(demand / cfg.high_water - 1e-9) if demand > 0 else 0


def _slope(history: list[tuple[float, float]], window: float) -> float:
    """How fast the demand rises (replicas per second): the smaller of the least-squares slopes
    over the window's two halves. A ramp rises in both; a step (a burst, a closed loop
    starting) rises in one half only and reads as no trend."""
    if not history:
        return 0.0
    mid = history[-1][0] - window / 2
    return min(_ls_slope([p for p in history if p[0] < mid]), _ls_slope([p for p in history if p[0] >= mid]))


def _ls_slope(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    mt = sum(t for t, _ in points) / len(points)
    md = sum(d for _, d in points) / len(points)
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (d - md) for t, d in points) / var if var > 0 else 0.0


def _recent_peak(now: float, cfg: PolicyConfig, state: dict) -> int:
    """The most replicas the demand wanted over the last downscale_delay_s: a release keeps them."""
    return max((w for t, w in state.get("wanted") or () if now - t <= cfg.downscale_delay_s), default=0)


def _release_idle(
    now: float, target: int, live: list[ReplicaLoad], floor: int, cfg: PolicyConfig, state: dict, seen: dict
) -> Decision:
    """Down by the replicas at the newest end (the ones Ray stops) idle for the delay, never
    below ``floor``. An idle replica behind a busy newer one stays: Ray would stop the busy
    one; the router feeds the newest only when no other has room, so it empties soon."""
    released = _recent(state, "released", now, cfg)  # Serve may list a replica it stops as running
    newest_first = [r for r in reversed(live) if r.replica not in released]
    idle = [idle_for(r, now, seen) for r in newest_first]
    count = next((i for i, t in enumerate(idle) if t < cfg.downscale_delay_s), len(newest_first))
    # Ray scales to zero only from one (autoscaling_policy._apply_delay_logic turns 3 -> 0 into
    # 3 -> 1): asked for 0 from more, it keeps the oldest, which `released` would then hide for
    # release_grace_s. So down to one first; the oldest goes on the next decision once Serve has
    # stopped the rest (measured: the ramp test's last replica idled 10 s longer without this)
    count = min(count, target - max(floor, 1 if target > 1 else 0))
    if count <= 0:
        return Decision(target, "hold", "steady")
    going = tuple(r.replica for r in newest_first[:count])
    released.update({r: now for r in going})
    return Decision(target - count, "idle", f"{count} replica(s) idle for >= {cfg.downscale_delay_s:g}s", going)


def _recent(state: dict, key: str, now: float, cfg: PolicyConfig) -> dict[str, float]:
    """state[key] (replica → when) without entries older than release_grace_s."""
    state[key] = {k: t for k, t in (state.get(key) or {}).items() if now - t < cfg.release_grace_s}
    return state[key]


def _since(state: dict, key: str, condition: bool, now: float) -> float:
    """How long ``condition`` has held (0 when it does not), tracked in ``state[key]``."""
    if not condition:
        state[key] = None
        return 0.0
    if state.get(key) is None:
        state[key] = now
    return now - state[key]


def ray_autoscaling_config(user: dict, max_batch: int = 1) -> dict:
    """serve_config.yaml's `replica.autoscaling_config` → what Ray Serve gets. Without a
    `policy` of its own the deployment uses ConsolidatingPolicy: the delays and the policy's
    keys move into its kwargs (with the replicas' ``max_batch``, their room before the first
    report) and Ray's delay timer is zeroed, so they are not applied twice. A config that names
    a policy (e.g. Ray's default) is passed through untouched."""
    if "policy" in user:
        return dict(user)
    if "busy_newer_wait_s" in user:
        raise ValueError(
            "autoscaling_config.busy_newer_wait_s is no longer supported: an idle replica behind a busy "
            "newer one now waits for that one to empty (only idle replicas are released)"
        )
    config = {**DEFAULTS, **user}
    kwargs = {
        "upscale_delay_s": config.pop("upscale_delay_s"),
        "downscale_delay_s": config.pop("downscale_delay_s"),
        "max_batch": max_batch,
    }
    for key in POLICY_KEYS:
        if key in config:
            kwargs[key] = config.pop(key)
    config.pop("downscale_to_zero_delay_s", None)
    return {
        **config,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "policy": {"policy_function": POLICY_PATH, "policy_kwargs": kwargs},
    }
