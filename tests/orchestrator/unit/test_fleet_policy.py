"""The fleet's policy: admission by priority then arrival, shrink before suspend, quotas, growth
into idle hosts that never starves a waiting job."""

from orchestrator.fleet.policy import FleetPolicyConfig, JobView, Quota, allocate


def job(id, priority=0, min_hosts=1, max_hosts=4, arrival=0, held=0, queue="default", **kw):
    return JobView(id, priority, queue, min_hosts, max_hosts, arrival, held, **kw)


def test_a_job_alone_gets_its_maximum_and_a_second_one_the_idle_hosts():
    a = allocate([job("a")], 6)
    assert a.hosts == {"a": 4} and not a.reasons
    b = allocate([job("a", held=4), job("b", arrival=1)], 6)
    assert b.hosts == {"a": 4, "b": 2}
    assert b.reasons == {"b": "2 of at most 4 hosts: the other 4 are held or kept for waiting jobs"}


def test_a_higher_priority_job_shrinks_a_lower_one_to_what_it_needs_and_it_grows_back():
    low = job("low", priority=0, min_hosts=1, max_hosts=4, held=4)
    high = job("high", priority=5, min_hosts=2, max_hosts=2, arrival=1)
    a = allocate([low, high], 4)
    assert a.hosts == {"low": 2, "high": 2}
    assert a.reasons == {"low": "shrunk to 2 of 4 hosts for a job of higher priority"}
    assert allocate([job("low", held=2)], 4).hosts == {"low": 4}  # the high one finished


def test_victims_are_shrunk_to_their_minimums_before_any_is_suspended():
    mid = job("mid", priority=1, min_hosts=2, max_hosts=4, held=3, arrival=0)
    low = job("low", priority=0, min_hosts=2, max_hosts=4, held=3, arrival=1)
    urgent = job("urgent", priority=9, min_hosts=2, max_hosts=2, arrival=2)
    assert allocate([mid, low, urgent], 6).hosts == {"mid": 2, "low": 2, "urgent": 2}
    # Needing more than shrinking frees: the lowest priority is suspended, the other kept at its minimum.
    big = job("urgent", priority=9, min_hosts=4, max_hosts=4, arrival=2)
    a = allocate([mid, low, big], 6)
    assert a.hosts == {"mid": 2, "low": 0, "urgent": 4}
    assert a.reasons["low"] == "waiting for hosts: needs 2, 0 idle, 6 held by jobs of priority 0 or higher"


def test_the_cheapest_victim_to_resize_is_shrunk_first():
    fresh = job("fresh", held=4, since_snapshot=0, smaller_ready=True, arrival=0)
    stale = job("stale", held=4, since_snapshot=7, smaller_ready=False, arrival=1)
    high = job("high", priority=1, min_hosts=2, max_hosts=2, arrival=2)
    assert allocate([fresh, stale, high], 8).hosts == {"fresh": 2, "stale": 4, "high": 2}
    ready = job("ready", held=4, since_snapshot=3, smaller_ready=True, arrival=1)
    assert allocate([job("cold", held=4, since_snapshot=3), ready, high], 8).hosts["ready"] == 2


def test_equal_priorities_never_take_from_each_other_and_growth_keeps_hosts_for_the_one_waiting():
    running = job("running", min_hosts=1, max_hosts=3, held=3, arrival=0)
    waiting = job("waiting", min_hosts=2, max_hosts=4, arrival=1)
    later = job("later", min_hosts=1, max_hosts=4, held=1, arrival=2)
    a = allocate([running, waiting, later], 5)
    # One host idle: too few for the waiting job, and kept from the later one, which would
    # otherwise grow into it and hold it when the first job ends.
    assert a.hosts == {"running": 3, "waiting": 0, "later": 1}
    assert a.reasons["waiting"] == "waiting for hosts: needs 2, 1 idle, 4 held by jobs of priority 0 or higher"
    done = allocate([job("waiting", min_hosts=2, max_hosts=4, arrival=1), later], 5)
    assert done.hosts == {"waiting": 3, "later": 2}  # admitted, then round-robin growth


def test_an_earlier_job_of_equal_priority_grows_into_hosts_a_later_one_cannot_use_yet():
    first = job("first", min_hosts=1, max_hosts=4, held=3, arrival=0)
    second = job("second", min_hosts=2, max_hosts=2, arrival=1)
    assert allocate([first, second], 4).hosts == {"first": 4, "second": 0}


def test_quotas_bound_a_queue_and_say_so():
    config = FleetPolicyConfig({"default": Quota(), "research": Quota(hosts=3)})
    r1 = job("r1", queue="research", min_hosts=2, max_hosts=4, held=2, arrival=0)
    r2 = job("r2", queue="research", min_hosts=2, max_hosts=2, arrival=1)
    other = job("other", min_hosts=1, max_hosts=2, arrival=2)
    a = allocate([r1, r2, other], 8, config)
    assert a.hosts == {"r1": 3, "r2": 0, "other": 2}
    assert a.reasons == {
        "r1": "queue 'research' is at its quota of 3 hosts",
        "r2": "queue 'research' is at its quota: 3 of 3 hosts held, 2 more needed",
    }


def test_a_minimum_beyond_the_cluster_waits_with_the_reason():
    a = allocate([job("huge", min_hosts=9, max_hosts=9)], 4)
    assert a.hosts == {"huge": 0}
    assert a.reasons == {"huge": "its minimum of 9 hosts exceeds the cluster's 4"}


def test_a_job_that_shrinking_cannot_make_room_for_waits_and_says_who_holds_the_hosts():
    peer = job("peer", priority=5, min_hosts=3, max_hosts=3, held=3, arrival=0)
    low = job("low", priority=0, min_hosts=1, max_hosts=4, held=1, arrival=1)
    high = job("high", priority=5, min_hosts=3, max_hosts=3, arrival=2)
    a = allocate([peer, low, high], 4)
    assert a.hosts == {"peer": 3, "low": 1, "high": 0}  # suspending low would free 1 of the 3 needed: it is left alone
    assert a.reasons["high"] == (
        "waiting for hosts: needs 3, 0 idle, 3 held by jobs of priority 5 or higher, "
        "1 by lower-priority jobs at their minimums"
    )


def test_the_fleet_file_gives_quotas_and_refuses_what_the_fleet_cannot_run(tmp_path):
    import pytest

    from orchestrator.fleet.config import FleetConfigError, check_queue, load_fleet

    path = tmp_path / "fleet.toml"
    path.write_text("[queues.research]\nhosts = 2\n[queues.prod]\n")
    config = load_fleet(path)
    assert config.quotas == {"default": Quota(), "research": Quota(2), "prod": Quota()}
    check_queue(config, "research", 2, "a")
    with pytest.raises(
        FleetConfigError,
        match=r"names queue 'nope', which the fleet does not have; its queues: default, prod, research",
    ):
        check_queue(config, "nope", 1, "a")
    with pytest.raises(
        FleetConfigError, match=r"needs at least 3 hosts \(hosts.min\) but queue 'research' may hold at most 2"
    ):
        check_queue(config, "research", 3, "a")
    for text, message in (
        ("[queues.x]\nhosts = 0\n", r"queues.x.hosts must be a whole number of hosts of at least 1"),
        ("[queues.x]\nhosts = 'two'\n", r"queues.x.hosts must be a whole number"),
        ("[queues.x]\nslots = 2\n", r"unknown key queues.x.slots; allowed: queues.x.hosts"),
        ("quotas = 1\n", r"unknown key quotas"),
        ("[queues\n", r"is not valid TOML"),
    ):
        path.write_text(text)
        with pytest.raises(FleetConfigError, match=message):
            load_fleet(path)
    with pytest.raises(FleetConfigError, match="does not exist"):
        load_fleet(tmp_path / "missing.toml")


def test_a_job_below_its_minimum_is_admitted_again_before_lower_priority_jobs():
    # `big` (min 4) holds 2 of its 4: a host died, or (as the scheduler counts it) two are still
    # being given back. Its hosts are never handed to a lower-priority job waiting behind it,
    # and it never keeps fewer than its minimum.
    big = job("big", priority=5, min_hosts=4, max_hosts=4, held=2, arrival=1)
    low = job("low", priority=0, min_hosts=1, max_hosts=4, arrival=0)
    assert allocate([big, low], 4).hosts == {"big": 4, "low": 0}
    short = allocate([big, low], 3)  # the cluster lost a host: big waits, low runs meanwhile
    assert short.hosts == {"big": 0, "low": 3}
    assert short.reasons["big"] == "its minimum of 4 hosts exceeds the cluster's 3"


def test_a_job_whose_growth_would_not_pay_keeps_its_hosts_and_leaves_idle_ones_to_others():
    ending = job("ending", held=2, grows=False)
    a = allocate([ending], 4)
    assert a.hosts == {"ending": 2}
    assert a.reasons == {"ending": "2 of at most 4 hosts: growing would not pay for its resize in the steps left"}
    b = allocate([ending, job("new", arrival=1, max_hosts=2)], 4)
    assert b.hosts == {"ending": 2, "new": 2}
    assert allocate([job("fresh", grows=False)], 4).hosts == {"fresh": 4}  # admitted now: starts on its maximum


def test_jobs_that_run_whole_slices_hold_gain_and_give_up_a_slice_at_a_time():
    # 3 slices of 2 hosts: a TPU job grows by whole slices, never into half of one.
    a = allocate([job("tpu", min_hosts=2, max_hosts=6, unit=2)], 5)
    assert a.hosts == {"tpu": 4}
    # A host of one of its slices died: it holds one whole slice, and is a waiting job below its minimum.
    assert allocate([job("tpu", min_hosts=2, max_hosts=6, held=3, unit=2)], 5).hosts == {"tpu": 4}
    lost = allocate([job("tpu", min_hosts=4, max_hosts=6, held=5, unit=2)], 5)
    assert lost.hosts == {"tpu": 4}  # 5 held is 2 whole slices: still at its minimum
    # A higher priority needing 1 host shrinks the TPU job by a whole slice, not by one host.
    low = job("tpu", priority=0, min_hosts=2, max_hosts=6, held=6, unit=2)
    high = job("gpu", priority=5, min_hosts=1, max_hosts=1, arrival=1)
    a = allocate([low, high], 6)
    assert a.hosts == {"tpu": 4, "gpu": 1}  # the other host of the slice given up stays idle
    assert a.reasons["tpu"] == "shrunk to 4 of 6 hosts for a job of higher priority"
    # A quota with room for one host more than it holds does not let a slice job grow.
    quotas = FleetPolicyConfig({"default": Quota(), "tpu": Quota(3)})
    assert allocate([job("t", min_hosts=2, max_hosts=6, unit=2, queue="tpu")], 6, quotas).hosts == {"t": 2}


def test_hosts_are_chosen_whole_slices_for_slice_jobs_and_packed_for_the_others():
    from orchestrator.fleet.scheduler import choose_hosts

    said = {f"n{i}": "abc"[i // 2] for i in range(6)}  # slices a, b, c of 2 hosts
    free = {n: s for n, s in said.items() if n != "n2"}  # n2 (slice b) is another job's
    assert choose_hosts(free, said, 4, 2, set()) == ["n0", "n1", "n4", "n5"]  # never half of b
    assert choose_hosts(free, said, 3, 2, set()) == ["n0", "n1"]  # whole slices only
    assert choose_hosts(free, said, 1, 1, set()) == ["n3"]  # into the slice already broken into
    assert choose_hosts(free, said, 1, 1, {"c"}) == ["n4"]  # beside its own hosts first
    assert choose_hosts(free, said, 0, 1, set()) == []
