"""The stop agreement: every process of a group stops after the same step, the one process 0
decides, and checks it at checkpoint boundaries and about every `check_seconds` between them."""

import numpy as np

from orchestrator.protocol import Stop
from orchestrator.worker.agreement import StopAgreement


class Process0:
    """The broadcast: every process gets process 0's proposal; records the steps it was asked at."""

    def __init__(self, stop=Stop.RUN, snapshots=0, digest=False, replica_every=0):
        self.stop, self.snapshots, self.digest, self.asked = stop, snapshots, digest, []
        self.replica_every = replica_every

    def __call__(self, proposal):
        self.asked.append(proposal.copy())
        return np.array([int(self.stop), proposal[1], self.snapshots, int(self.digest), self.replica_every], np.int32)


def test_one_process_asks_its_own_flag_every_step():
    asked = iter([Stop.RUN, Stop.AT_CHECKPOINT])
    agreement = StopAgreement(lambda: next(asked), processes=1, propose_snapshots=lambda: 3)
    assert agreement.agree(1, False, 0.1) is Stop.RUN and agreement.snapshot_every == 3
    assert agreement.agree(2, False, 0.1) is Stop.AT_CHECKPOINT


def test_a_group_acts_on_process_0s_decision_not_on_its_own():
    process0 = Process0(stop=Stop.NOW, snapshots=4)
    mine = StopAgreement(lambda: Stop.RUN, processes=2, broadcast=process0)  # this host saw no request
    assert mine.agree(5, True, 0.1) is Stop.NOW and mine.snapshot_every == 4


def test_it_checks_at_boundaries_and_about_every_check_seconds_between_them():
    process0 = Process0()
    agreement = StopAgreement(lambda: Stop.RUN, processes=2, check_seconds=0.5, broadcast=process0)
    checked = []
    for step in range(1, 31):
        before = len(process0.asked)
        agreement.agree(step, step % 10 == 0, 0.1)
        if len(process0.asked) > before:
            checked.append(step)
    # Never at a segment's first step (the broadcast's first run compiles); then about every 5
    # steps of 0.1 s (0.5 s), and at every boundary.
    assert checked[0] == 2 and {10, 20, 30} <= set(checked)
    assert all(b - a <= 5 for a, b in zip(checked, checked[1:])) and len(checked) <= 30 // 5 + 3
    assert [int(p[1]) for p in process0.asked] == [5] * len(checked)  # the interval it proposed


def test_a_stop_asked_between_checks_waits_for_the_next_check():
    flag = [Stop.RUN]
    agreement = StopAgreement(lambda: flag[0], processes=2, check_seconds=1.0, broadcast=Process0(stop=Stop.RUN))
    agreement.agree(1, False, 0.1)
    agreement.agree(2, False, 0.1)  # checked: the next check is 10 steps on
    flag[0] = Stop.NOW
    assert agreement.agree(3, False, 0.1) is Stop.RUN  # not a step to check at: no collective


def test_the_digest_rides_with_snapshots_once_process_0_has_it_and_stays_on():
    # A process whose digest compiled first must not dispatch it alone: the digest has
    # collectives, and the others would wait on them for ever (a pipelined job hung so).
    process0 = Process0(digest=False)
    mine = StopAgreement(lambda: Stop.RUN, processes=2, broadcast=process0, propose_digest=lambda: True)
    mine.agree(10, True, 0.1)
    assert not mine.digest_ready  # this process's own compile does not decide
    process0.digest = True
    mine.agree(20, True, 0.1)
    assert mine.digest_ready
    process0.digest = False
    mine.agree(30, True, 0.1)
    assert mine.digest_ready  # once agreed, every later snapshot carries it


def test_the_replicas_interval_is_process_0s_and_once_agreed_stays():
    process0 = Process0(replica_every=7)
    mine = StopAgreement(lambda: Stop.RUN, processes=2, broadcast=process0, propose_replica_every=lambda: 3)
    assert mine.replica_every == 0
    mine.agree(10, True, 0.1)
    assert mine.replica_every == 7 and process0.asked[-1][4] == 3  # this host proposed its own, got process 0's
    process0.replica_every = 9
    mine.agree(20, True, 0.1)
    assert mine.replica_every == 7  # (every process compares at the same steps for the rest of the segment)
