"""The autoscaling policy as Ray Serve calls it: `ConsolidatingPolicy` (the class-callable
form, built once in the controller with the config's `policy_kwargs`) reads each replica's
latest report and Serve's order from the AutoscalingContext, asks `cluster.autoscaling.decide`,
logs every change of the target with its reason, and exports the autoscaler's metrics."""

from __future__ import annotations

import logging
import time

from cluster.autoscaling import Decision, PolicyConfig, ReplicaLoad, decide

log = logging.getLogger("ray.serve")


def latest_loads(raw_metrics: dict | None, running_replicas) -> list[ReplicaLoad]:
    """Each running replica's newest report (ctx.raw_metrics: metric → replica → time series),
    in the order of ``running_replicas``: Serve's, oldest first."""
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

    STATE = ("waiting_since", "short_since", "released", "demand", "wanted", "seen")

    def __init__(self, upscale_delay_s: float = 1.0, downscale_delay_s: float = 30.0, **kwargs):
        self.cfg = PolicyConfig(upscale_delay_s, downscale_delay_s, **kwargs)
        self._metrics = None

    def __call__(self, ctx) -> tuple[int, dict]:
        now = ctx.current_time or time.time()
        state = {k: ctx.policy_state.get(k) for k in self.STATE}
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
                "autoscaling %s: %d -> %d replicas (%s: %s)%s; replicas, oldest first: %s",
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
