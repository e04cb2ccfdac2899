"""The autoscaling policy's decisions as a pure function (no Ray), and how serve_config's
autoscaling_config becomes Ray's. Loads are listed oldest first, in Serve's order: Ray stops
the last first."""

import pytest

from app.serving.config import parse_args
from cluster.autoscaling import POLICY_PATH, PolicyConfig, ReplicaLoad, decide, ray_autoscaling_config

CFG = PolicyConfig(upscale_delay_s=2.0, downscale_delay_s=10.0, high_water=0.9, trend_window_s=10.0)


def load(name, running=0, waiting=0, idle_since=0.0, free_kv=100, max_batch=8, draining=False, started_at=0.0):
    return ReplicaLoad(name, running, waiting, max_batch, free_kv, 100, idle_since, draining, started_at)


def run(ticks, target, current, min_r=0, max_r=8, cfg=CFG):
    """ticks: [(now, loads, queued)] → the decisions, one shared state like the controller's."""
    state, out = {}, []
    for now, loads, queued in ticks:
        d = decide(now, target, current, loads, queued, min_r, max_r, cfg, state)
        out.append(d)
        target = current = d.target
    return out


def test_waiting_requests_scale_up_after_the_delay_by_what_they_need():
    busy = [load("a", running=8)]
    ds = run([(0.0, busy, 20), (1.0, busy, 20), (2.5, busy, 20)], target=1, current=1)
    assert [d.reason for d in ds] == ["hold", "hold", "queue"]
    assert ds[-1].target == 1 + 3  # ⌈20 / 8⌉ more replicas


def test_a_queue_that_clears_before_the_delay_adds_nothing():
    busy = [load("a", running=7)]  # below the high-water mark: only the queue could add a replica
    ds = run([(0.0, busy, 5), (1.5, busy, 0), (2.5, busy, 5), (4.0, busy, 5)], target=1, current=1)
    assert all(d.target == 1 for d in ds)


def test_a_queue_shorter_than_half_the_look_back_window_is_no_queue():
    busy = [load("a", running=2, max_batch=2)]  # Ray's queued is a mean over the window
    no_high_water = PolicyConfig(upscale_delay_s=2.0, downscale_delay_s=10.0, high_water=2.0)
    assert all(d.target == 1 for d in run([(t / 10, busy, 0.3) for t in range(40)], 1, 1, cfg=no_high_water))
    ds = run([(t / 10, busy, 0.6) for t in range(25)], 1, 1, cfg=no_high_water)
    assert [(d.reason, d.target) for d in ds if d.reason != "hold"][0] == ("queue", 2)


def test_requests_held_at_the_router_while_a_replica_reports_room_are_no_queue():
    steady = [load("a", running=3, max_batch=5)]
    assert all(d.target == 1 for d in run([(t / 10, steady, 2.0) for t in range(40)], target=1, current=1))
    ds = run([(t / 10, steady, 4.0) for t in range(25)], target=1, current=1)
    assert [(d.reason, d.target) for d in ds if d.reason != "hold"][0] == ("queue", 2)  # 2 beyond its room


def test_requests_an_engine_queues_only_until_its_next_step_are_no_queue():
    arriving = [load("a", running=2, waiting=1, max_batch=5)]  # room: admitted at the next step
    assert all(d.target == 1 for d in run([(t / 10, arriving, 0) for t in range(40)], target=1, current=1))
    kv_full = [load("a", running=2, waiting=1, max_batch=5, free_kv=5)]
    ds = run([(t / 10, kv_full, 0) for t in range(25)], target=1, current=1)
    assert [(d.reason, d.target) for d in ds if d.reason != "hold"][0] == ("queue", 2)


def test_replicas_already_starting_count_against_the_need():
    state = {"waiting_since": 0.0}
    d = decide(3.0, 3, 1, [load("a", running=8)], 12, 0, 8, CFG, state)
    assert d.target == 3  # ⌈12 / 8⌉ = 2 needed, 2 already starting
    d = decide(3.0, 3, 1, [load("a", running=8)], 30, 0, 8, CFG, state)
    assert (d.reason, d.target) == ("queue", 1 + 4)


def test_max_replicas_bounds_the_scale_up():
    d = decide(5.0, 2, 2, [load("a", running=8), load("b", running=8)], 100, 0, 4, CFG, {"waiting_since": 0.0})
    assert d.target == 4


def test_demand_above_high_water_adds_what_it_needs():
    full = [load("a", running=8), load("b", running=2, free_kv=5)]  # batch full / KV 95 % used
    ds = run([(0.0, full, 0), (2.5, full, 0)], target=2, current=2)
    assert [(d.reason, d.target) for d in ds] == [("hold", 2), ("high_water", 3)]
    one_with_room = [load("a", running=8), load("b", running=2)]
    assert run([(0.0, one_with_room, 0), (5.0, one_with_room, 0)], target=2, current=2)[-1].target == 2


def test_down_only_by_the_replicas_idle_for_the_delay_at_the_newest_end():
    loads = [load("a", running=3), load("b", idle_since=100.0), load("c", idle_since=105.0)]
    # b has been idle for the delay, but Ray would stop c, the newest, idle for only 6 s
    assert decide(111.0, 3, 3, loads, 0, 0, 8, CFG, {}).target == 3
    d = decide(116.0, 3, 3, loads, 0, 0, 8, CFG, {})
    assert (d.reason, d.target, d.going) == ("idle", 1, ("c", "b"))


def test_no_downscale_while_the_replica_ray_would_stop_was_busy_within_the_delay():
    # "new" held a request until 105: however long "old" has idled, nothing goes before 115
    loads = [load("old", idle_since=1.0), load("new", idle_since=105.0)]
    ticks = [(t, loads, 0) for t in (106.0, 110.0, 114.9)]
    assert {d.target for d in run(ticks, target=2, current=2)} == {2}
    d = decide(115.0, 2, 2, loads, 0, 0, 8, CFG, {})
    assert (d.reason, d.going) == ("idle", ("new",))  # then "old": Ray goes to zero only from one
    # still busy: never, and an idle older replica does not make Ray stop it
    busy = [load("old", idle_since=1.0), load("new", running=1)]
    assert {d.target for d in run([(t, busy, 0) for t in range(0, 600, 5)], target=2, current=2)} == {2}


def test_the_order_serve_lists_decides_which_goes_not_the_reported_start_time():
    loads = [load("first", idle_since=1.0, started_at=9.0), load("second", running=2, started_at=1.0)]
    assert decide(500.0, 2, 2, loads, 0, 0, 8, CFG, {}).target == 2  # Ray stops "second", which is busy


def test_an_idle_replica_stays_while_the_demand_of_the_delay_needs_it():
    full = [load("a", running=8), load("b", running=8), load("c", idle_since=1.0)]
    assert decide(50.0, 3, 3, full, 0, 0, 8, CFG, {}).target == 3
    room = [full[0], load("b", running=4), full[2]]
    d = decide(50.0, 3, 3, room, 0, 0, 8, CFG, {})
    assert (d.reason, d.target, d.going) == ("idle", 2, ("c",))
    # the demand wanted 3 replicas until 55: c stays until that has left the delay's window
    ticks = [(t, full, 0) for t in (50.0, 55.0)] + [(t, room, 0) for t in (56.0, 64.0, 65.5)]
    assert [d.target for d in run(ticks, target=3, current=3)] == [3, 3, 3, 3, 2]


def test_upscale_on_a_rising_trend_before_any_request_waits():
    # one replica of batch 8 filling by one request a second: nothing waits, the level wants one
    # replica, but 10 s ahead (upscale_lead_s) the demand would fill it past high water
    ticks = [(t / 2, [load("a", running=1 + t // 4)], 0) for t in range(25)]
    ds = run(ticks, target=1, current=1)
    assert all(r.waiting == 0 and r.running < 0.9 * 8 for _, (r,), _ in ticks)
    assert [(d.reason, d.target) for d in ds if d.reason != "hold"][0] == ("trend", 2)
    # however steep, the trend asks for one replica beyond today's level at most
    steep = {"demand": [(t / 10, t / 20) for t in range(100)], "short_since": 0.0}
    d = decide(10.0, 1, 1, [load("a", running=4)], 0, 0, 8, CFG, steep)
    assert (d.reason, d.target) == ("trend", 2)
    flat = [(float(t), [load("a", running=5)], 0) for t in range(30)]
    assert {d.target for d in run(flat, target=1, current=1)} == {1}  # the same level, steady: no trend
    # a step (a burst, closed loops starting) rises in one half of the window only: no trend
    step = [(t / 2, [load("a", running=0 if t < 10 else 6, idle_since=0.0)], 0) for t in range(40)]
    assert {d.target for d in run(step, target=1, current=1)} == {1}


def test_min_idle_replicas_keeps_a_warm_spare():
    spare = PolicyConfig(upscale_delay_s=2.0, downscale_delay_s=10.0, high_water=0.9, min_idle_replicas=1)
    ticks = [(float(t), [load("a", running=3)], 0) for t in range(4)]
    assert [(d.reason, d.target) for d in run(ticks, 1, 1, cfg=spare) if d.reason != "hold"][0] == ("spare", 2)
    kept = [load("a", running=3), load("b", idle_since=1.0)]
    assert decide(500.0, 2, 2, kept, 0, 0, 8, spare, {}).target == 2
    assert decide(500.0, 2, 2, kept, 0, 0, 8, CFG, {}).target == 1


def test_a_replica_released_once_is_not_counted_again_while_serve_stops_it():
    loads = [load("a", running=3), load("b", idle_since=1.0)]
    state = {}
    assert decide(50.0, 2, 2, loads, 0, 0, 8, CFG, state).target == 1
    # Serve still lists b as running (current = target = 1 after its own bookkeeping)
    assert decide(50.2, 1, 1, loads, 0, 0, 8, CFG, state).target == 1
    assert decide(61.0, 2, 2, loads, 0, 0, 8, CFG, state).target == 1  # still there after the grace: counted again


def test_never_below_min_replicas_and_scale_to_zero_when_allowed():
    idle = [load("a", idle_since=1.0), load("b", idle_since=1.0)]
    assert decide(50.0, 2, 2, idle, 0, 1, 8, CFG, {}).target == 1
    assert decide(50.0, 1, 1, idle[:1], 0, 0, 8, CFG, {}).target == 0
    d = decide(60.0, 0, 0, [], 3, 0, 8, CFG, {})
    assert (d.reason, d.target) == ("cold_start", 1)
    assert decide(60.0, 0, 0, [], 0, 0, 8, CFG, {}).target == 0


def test_to_zero_from_several_replicas_through_one_as_ray_allows():
    # Ray turns 3 -> 0 into 3 -> 1 (it scales to zero only from one): a 0 here would mark the
    # oldest released while Serve keeps it, and hide it from the next release for the grace
    idle = [load("a", idle_since=1.0), load("b", idle_since=1.0), load("c", idle_since=1.0)]
    state = {}
    d = decide(50.0, 3, 3, idle, 0, 0, 8, CFG, state)
    assert (d.reason, d.target, d.going) == ("idle", 1, ("c", "b"))
    assert decide(50.1, 1, 3, idle, 0, 0, 8, CFG, state).target == 1  # Serve stopping b and c
    d = decide(50.5, 1, 1, idle[:1], 0, 0, 8, CFG, state)  # well within release_grace_s
    assert (d.reason, d.target, d.going) == ("idle", 0, ("a",))


def test_a_replica_started_from_zero_is_not_released_before_the_request_it_was_started_for_reaches_it():
    # Seen live under a CPU hog: the replica's idle clock starts in its constructor (at 5); Serve
    # lists it running at 40, its report says idle for 35 s, the request waiting for it has just
    # left the handle's queue (Ray's mean falls below 0.5) and has not reached it yet
    state = {}
    assert decide(1.0, 0, 0, [], 1.0, 0, 8, CFG, state).reason == "cold_start"
    fresh = [load("a", idle_since=5.0)]
    assert decide(40.0, 1, 1, fresh, 0.4, 0, 8, CFG, state).target == 1  # a request was queued in the window
    assert decide(41.0, 1, 1, fresh, 0.0, 0, 8, CFG, state).target == 1  # idle 1 s since Serve listed it
    d = decide(50.0, 1, 1, fresh, 0.0, 0, 8, CFG, state)  # still nothing after the delay: it goes
    assert (d.reason, d.target, d.going) == ("idle", 0, ("a",))


def test_before_any_report_a_starting_replica_holds_the_deployments_batch():
    # from zero, 6 requests wait while the first replica starts: it takes all six (batch 8), so the
    # queue rule adds none; assuming a batch of 1 it asked for 5 more replicas
    state, batch8 = {}, PolicyConfig(upscale_delay_s=2.0, downscale_delay_s=10.0, max_batch=8)
    assert decide(0.0, 0, 0, [], 6.0, 0, 8, batch8, state).target == 1
    assert all(decide(t, 1, 1, [], 6.0, 0, 8, batch8, state, unreported=1).target == 1 for t in (1.0, 3.0, 5.0))
    state, batch1 = {}, PolicyConfig(upscale_delay_s=2.0, downscale_delay_s=10.0)
    decide(0.0, 0, 0, [], 6.0, 0, 8, batch1, state)
    assert max(decide(t, 1, 1, [], 6.0, 0, 8, batch1, state, unreported=1).target for t in (1.0, 3.0, 5.0)) == 6


def test_no_scale_down_while_requests_wait_or_replicas_start_or_stop():
    idle = [load("a", running=8), load("b", idle_since=1.0)]
    assert decide(50.0, 2, 2, idle, 1, 0, 8, CFG, {}).target == 2  # something waits: b will get it
    assert decide(50.0, 3, 2, idle, 0, 0, 8, CFG, {}).target == 3  # a third replica is starting
    assert decide(50.0, 1, 2, idle, 0, 0, 8, CFG, {}).target == 1  # b is being stopped: not again


def test_a_running_replica_that_has_not_reported_holds_the_downscale_and_counts_as_starting():
    loads = [load("a", idle_since=1.0, started_at=1)]  # b runs but has not reported: it is the newest
    assert decide(50.0, 2, 2, loads, 0, 0, 8, CFG, {}, unreported=1).target == 2
    busy = [load("a", running=8, started_at=1)]
    assert decide(50.0, 2, 2, busy, 8, 0, 8, CFG, {"waiting_since": 0.0, "short_since": 0.0}, unreported=1).target == 2


def test_draining_and_unreported_replicas_are_neither_idle_nor_full():
    loads = [load("a", running=8), load("b", idle_since=1.0, draining=True)]
    d = decide(50.0, 2, 2, loads, 0, 0, 8, CFG, {"short_since": 0.0})
    assert (d.reason, d.target) == ("high_water", 3)


def test_steady_load_holds():
    steady = [load("a", running=5)]
    ds = run([(t, steady, 0) for t in range(0, 120, 3)], target=1, current=1)
    assert {d.target for d in ds} == {1}


def test_config_moves_the_delays_into_the_policy():
    ray = ray_autoscaling_config(
        {
            "min_replicas": 0,
            "max_replicas": 4,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 20,
            "downscale_to_zero_delay_s": 60,
        }
    )
    assert ray["policy"] == {
        "policy_function": POLICY_PATH,
        "policy_kwargs": {"upscale_delay_s": 0.5, "downscale_delay_s": 20, "max_batch": 1},
    }
    assert ray["upscale_delay_s"] == ray["downscale_delay_s"] == 0.0 and "downscale_to_zero_delay_s" not in ray
    own = {"max_replicas": 4, "policy": {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}}
    assert ray_autoscaling_config(own) == own
    options = parse_args(
        {"max_batch_size": 12, "replica": {"autoscaling_config": {"max_replicas": 2}}}, "m"
    ).replica_options
    assert options["autoscaling_config"]["policy"]["policy_function"] == POLICY_PATH
    assert options["autoscaling_config"]["policy"]["policy_kwargs"]["max_batch"] == 12  # room before a report
    keys = ray_autoscaling_config({"min_idle_replicas": 1, "upscale_lead_s": 30, "trend_window_s": 20})
    assert keys["policy"]["policy_kwargs"] == {
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 30.0,
        "max_batch": 1,
        "min_idle_replicas": 1,
        "trend_window_s": 20,
        "upscale_lead_s": 30,
    }
    with pytest.raises(ValueError, match="busy_newer_wait_s"):
        ray_autoscaling_config({"busy_newer_wait_s": 5})
