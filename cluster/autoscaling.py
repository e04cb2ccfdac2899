"""Consolidation-aware autoscaling for LoraReplica (Punica: ask for another GPU only when
no replica has room; give back the ones that have gone idle).

Each replica pushes `record_autoscaling_stats()` (running, waiting, max batch, free KV
blocks, idle_since, draining) to the Serve controller every `metrics_interval_s`; the
controller calls this policy every 0.1 s with those reports (`ctx.raw_metrics`, the
latest sample of each replica is used) and the requests queued at the handles, i.e.
waiting in the router for a replica with room (`ctx.total_queued_requests`).

Decisions (`decide`, a pure function):
- up, when requests have waited for room for `upscale_delay_s` (queued at the router
  beyond the batch room the replicas report, or queued in an engine whose batch or KV is
  full): by as many replicas as that work needs (⌈waiting / max batch⌉, less
  the replicas already starting), within max_replicas;
- up by one, when every replica has been above `high_water` of its batch or of its KV
  blocks for `upscale_delay_s` (not within `release_grace_s` of a release: the streams
  of a released busy replica fill the others for a moment);
- down, only by the replicas that have held no request for `downscale_delay_s` and
  that Ray will stop (see below), and not while every other replica is above `high_water`
  (the idle one is about to be needed); min_replicas may be 0: the next
  request then waits at the handle while Serve starts a replica, Ray's cold-start path;
- otherwise hold. Every change is logged with its reason and counted in metrics.

Which replicas go is Ray's choice, not the policy's: Serve's
`deployment_scheduler._get_replicas_to_stop` stops replicas that are not running yet
first, then those on the nodes with the fewest replicas, and on a node the newest
first (one node: newest first). The router (cluster/router.py) breaks ties towards the
oldest replica, so the idle replicas are usually the newest ones; the policy orders the
replicas by the `started_at` they report and releases at once only the run of idle ones
at the newest end, the ones Ray stops. The router keeps a busy replica busy, so a newer replica
can stay busy while an older one idles: that older one is released after a further
`busy_newer_wait_s`, Ray then stops the busy newer replica in its place, and the router
sees it leave the running set: each of its streams is cancelled there and resumed on
another replica (app/openai/client_stream.py), so no stream is lost.

The delays are applied here, per replica and per waiting request, so `ray_autoscaling
_config` hands them to the policy and sets Ray's own delay timer (which counts
consecutive decisions on top) to 0.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

log = logging.getLogger("ray.serve")

POLICY_PATH = "cluster.autoscaling:ConsolidatingPolicy"
DEFAULTS = {"upscale_delay_s": 1.0, "downscale_delay_s": 30.0, "metrics_interval_s": 1.0, "look_back_period_s": 3.0}


@dataclass(frozen=True)
class PolicyConfig:
    upscale_delay_s: float = 1.0
    downscale_delay_s: float = 30.0
    # share of max batch or of KV blocks above which a replica counts as full: below 1, so the
    # next replica starts while the last quarter of the batches fills, not once requests wait
    high_water: float = 0.75
    release_grace_s: float = 10.0  # a replica asked to go, or made to take another's streams, is not counted
    # idle again for this long
    busy_newer_wait_s: float | None = None  # how long an idle replica waits for busier newer ones to empty
    # before one of those is released in its place (its streams migrate); None = downscale_delay_s


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
    started_at: float = 0.0  # Ray stops the newest first

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

    def full(self, high_water: float) -> bool:
        used_kv = self.total_kv_blocks - self.free_kv_blocks
        return self.running >= high_water * self.max_batch or used_kv >= high_water * self.total_kv_blocks

    def idle_for(self, now: float) -> float:
        return now - self.idle_since if self.idle_since > 0 and self.running == self.waiting == 0 else 0.0


@dataclass(frozen=True)
class Decision:
    target: int
    reason: str  # cold_start | queue | high_water | idle | idle_behind_busy | hold
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
    """The target replica count. ``state`` (mutated) keeps when waiting / all-full began and
    which replicas were released or made to take a released one's streams, and when.
    ``unreported``: running replicas with no report yet (just started: the newest, with room)."""
    live = [r for r in loads if not r.draining]
    # Requests queued at the router count only beyond the room the replicas report: the
    # router holds a request a moment longer than needed while a replica's report still
    # lists requests that have finished. queued is Ray's mean over look_back_period_s: a
    # request that waited for less than half of it is no queue.
    # An engine's waiting requests count when its batch or KV is full: with room, they are
    # just requests that arrived since its last step.
    room = sum(max(0, r.max_batch - r.running - r.waiting) for r in live)
    held = math.floor(queued + 0.5)
    waiting = max(0, held - room) + sum(
        r.waiting if r.full(cfg.high_water) else max(0, r.running + r.waiting - r.max_batch) for r in live
    )
    max_batch = max((r.max_batch for r in live), default=1)
    starting = max(0, target - current) + unreported  # replicas about to take work
    need = math.ceil(waiting / max_batch) if waiting > 0 else 0
    hot = bool(live) and all(r.full(cfg.high_water) for r in live)
    waited = _since(state, "waiting_since", waiting > 0, now)
    hot_for = _since(state, "full_since", hot, now)
    if current == 0 and target == 0:
        # no report yet says how much one replica holds: start one, the queue rule adds the rest
        return (
            Decision(1, "cold_start", f"{queued:.1f} waiting, no replica")
            if queued > 0
            else Decision(0, "hold", "no replica, no request")
        )
    if waiting > 0 and waited >= cfg.upscale_delay_s and need > starting:
        new = min(max_replicas, max(target, current + need))
        if new > target:
            return Decision(
                new, "queue", f"{waiting:.1f} requests waited {waited:.1f}s for room, {starting} replica(s) starting"
            )
    just_released = any(now - t < cfg.release_grace_s for t in (state.get("released") or {}).values())
    if hot and hot_for >= cfg.upscale_delay_s and starting == 0 and not just_released and target < max_replicas:
        return Decision(
            target + 1, "high_water", f"every replica above {cfg.high_water:.0%} of batch or KV for {hot_for:.1f}s"
        )
    if held or waiting or hot or current != target or unreported:
        return Decision(target, "hold", "busy or replicas starting/stopping")
    return _release_idle(now, target, live, min_replicas, cfg, state)


def _release_idle(
    now: float, target: int, live: list[ReplicaLoad], min_replicas: int, cfg: PolicyConfig, state: dict
) -> Decision:
    """Down by the replicas idle for the delay that Ray will stop: those at the newest end.
    An idle replica older than a busy one would make Ray stop the busy one: it counts only
    once it has waited `busy_newer_wait_s` more (the busy one may empty meanwhile); then the
    busy replica's streams migrate as it stops, most likely onto that idle replica, which is
    therefore not counted idle again for a while."""
    # Serve may list a replica it is stopping as running for a moment: count each once.
    released, spent = _recent(state, "released", now, cfg), _recent(state, "spent", now, cfg)
    newest_first = sorted((r for r in live if r.replica not in released), key=lambda r: -r.started_at)
    idle_for = [0.0 if r.replica in spent else r.idle_for(now) for r in newest_first]
    at_end = next((i for i, t in enumerate(idle_for) if t < cfg.downscale_delay_s), len(idle_for))
    patience = cfg.downscale_delay_s if cfg.busy_newer_wait_s is None else cfg.busy_newer_wait_s
    patient = [r.replica for r, t in zip(newest_first, idle_for) if t >= cfg.downscale_delay_s + patience]
    count = min(max(at_end, len(patient)), target - min_replicas)
    # keep an idle replica while every other is above high water: it is about to be needed
    # (releasing it now brought a scale-up right after, and the streams routed to it meanwhile moved)
    while count > 0 and all(r.full(cfg.high_water) for r in newest_first[count:]) and newest_first[count:]:
        count -= 1
    if count <= 0:
        return Decision(target, "hold", "steady")
    going = tuple(r.replica for r in newest_first[:count])  # what Ray stops, newest first
    released.update({r: now for r in going})
    if count <= at_end:
        return Decision(target - count, "idle", f"{count} replica(s) idle for >= {cfg.downscale_delay_s:g}s", going)
    spent.update({r: now for r in patient if r not in going})
    return Decision(
        target - count,
        "idle_behind_busy",
        f"{len(patient)} replica(s) idle for >= {cfg.downscale_delay_s + patience:g}s behind busier "
        f"newer ones, which Ray stops: their streams migrate",
        going,
    )


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


def latest_loads(raw_metrics: dict | None, running_replicas) -> list[ReplicaLoad]:
    """Each running replica's newest report (ctx.raw_metrics: metric → replica → time series)."""
    loads = []
    for replica in running_replicas:
        report = {}
        for name, by_replica in (raw_metrics or {}).items():
            series = by_replica.get(replica)
            if series:
                report[name] = series[-1].value
        try:
            loads.append(ReplicaLoad.from_report(getattr(replica, "unique_id", str(replica)), report))
        except KeyError:  # not reported yet (starting): neither idle nor full
            continue
    return loads


class ConsolidatingPolicy:
    """Ray Serve's class-callable policy form: instantiated once in the controller with
    the autoscaling config's `policy_kwargs`, then called with an AutoscalingContext."""

    def __init__(
        self,
        upscale_delay_s: float = 1.0,
        downscale_delay_s: float = 30.0,
        high_water: float = 0.75,
        busy_newer_wait_s: float | None = None,
    ):
        self.cfg = PolicyConfig(upscale_delay_s, downscale_delay_s, high_water, busy_newer_wait_s=busy_newer_wait_s)
        self._metrics = None

    def __call__(self, ctx) -> tuple[int, dict]:
        now = ctx.current_time or time.time()
        state = {k: ctx.policy_state.get(k) for k in ("waiting_since", "full_since", "released", "spent")}
        loads = latest_loads(ctx.raw_metrics, ctx.running_replicas)
        d = decide(
            now,
            ctx.target_num_replicas,
            ctx.current_num_replicas,
            loads,
            ctx.total_queued_requests or 0.0,
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
            self.cfg,
            state,
            len(ctx.running_replicas) - len(loads),
        )
        self._export(ctx, d, loads, now)
        if d.target != ctx.target_num_replicas:
            seen = ", ".join(f"{r.replica} {r.running}+{r.waiting} idle {r.idle_for(now):.1f}s" for r in loads)
            log.info(
                "autoscaling %s: %d -> %d replicas (%s: %s)%s; replicas: %s",
                ctx.deployment_name,
                ctx.target_num_replicas,
                d.target,
                d.reason,
                d.detail,
                f"; Ray stops: {', '.join(d.going)}" if d.going else "",
                seen,
            )
        return d.target, state

    def _export(self, ctx, d: Decision, loads: list[ReplicaLoad], now: float) -> None:
        if self._metrics is None:
            self._metrics = _PolicyMetrics()
        self._metrics.record(
            ctx.app_name or "",
            ctx.deployment_name,
            d,
            sum(r.idle_for(now) > 0 for r in loads),
            changed=d.target != ctx.target_num_replicas,
        )


class _PolicyMetrics:
    """Exported from the Serve controller: loraplex_autoscaler_target_replicas,
    _replicas_idle (gauges) and _decisions{reason} (counter, changes of the target only)."""

    def __init__(self):
        from ray.util.metrics import Counter, Gauge

        tags = ("application", "deployment")  # apps of one cluster may share a deployment name
        self.target = Gauge("loraplex_autoscaler_target_replicas", description="Target replica count", tag_keys=tags)
        self.idle = Gauge("loraplex_autoscaler_replicas_idle", description="Replicas holding no request", tag_keys=tags)
        self.decisions = Counter(
            "loraplex_autoscaler_decisions", description="Target changes by reason", tag_keys=(*tags, "reason")
        )

    def record(self, app: str, deployment: str, d: Decision, idle: int, changed: bool) -> None:
        tags = {"application": app, "deployment": deployment}
        self.target.set(d.target, tags=tags)
        self.idle.set(idle, tags=tags)
        if changed:
            self.decisions.inc(1, tags={**tags, "reason": d.reason})


def ray_autoscaling_config(user: dict) -> dict:
    """serve_config.yaml's `replica.autoscaling_config` → what Ray Serve gets. Without a
    `policy` of its own the deployment uses ConsolidatingPolicy: the delays move into its
    kwargs and Ray's delay timer is zeroed, so they are not applied twice. A config that
    names a policy (e.g. Ray's default) is passed through untouched."""
    if "policy" in user:
        return dict(user)
    config = {**DEFAULTS, **user}
    kwargs = {"upscale_delay_s": config.pop("upscale_delay_s"), "downscale_delay_s": config.pop("downscale_delay_s")}
    for key in ("high_water", "busy_newer_wait_s"):
        if key in config:
            kwargs[key] = config.pop(key)
    config.pop("downscale_to_zero_delay_s", None)
    return {
        **config,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "policy": {"policy_function": POLICY_PATH, "policy_kwargs": kwargs},
    }
