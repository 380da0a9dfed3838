"""Fault injection for tests, the demo and the fault storm: `--chaos lose@40,add@80,lose-in-save@50:0`.

Three parts, and nothing else of remesh knows of any: the faults (`faults`: the `--chaos`
spelling parsed, and when each falls due), `ChaosCallback` (`callback`), a controller callback
that kills, stops and adds hosts as faults fall due and attaches a `HostFaults` test hook to the
hosts that must hang or straggle, and `HostFaults` (`host`), that hook in the worker
(worker/hooks.py).

lose@S[:H[+H]]        after step S is reported, kill host H's node (default: the last host);
                      `lose@S:0+2` kills hosts 0 and 2 at once
lose-in-save@S[:H]    host H hangs instead of saving checkpoint S; its node is killed mid-save
lose-in-start@S[:H]   host H of the first group started after step S hangs as that group starts
lose-in-compile@S[:H] (before joining jax.distributed), compiles, or restores; its node is
lose-in-restore@S[:H] killed there, while the rest of the group waits on it
lose-slice@S[:K]      after step S is reported, kill every host of the group's slice K at once
                      (default: its last slice; a job laid out in slices, `hosts_per_slice`)
add@S                 after step S is reported, add one host to the cluster
add-in-recovery@S     the first recovery from a host loss after step S gets one host added to the
                      cluster while its new group starts
freeze@S[:H]          after step S is reported, stop host H's process (SIGSTOP): a hung host, alive
                      to Ray, that answers nothing
slow@S[:H]            from step S on, host H's input takes SLOW_INPUT_SECONDS longer each step:
                      a straggler (works on any cluster: nothing is killed)
hang@S[:H]            host H blocks as it dispatches step S, its actor still answering polls: a
                      step that never finishes (the health loop finds it; fires once)
flip@S[:H][xB]        after step S, bit B (default 30, a high exponent bit of a float32) of one
                      element of host H's copy of a replicated parameter flips: silent data
                      corruption in one copy (fires once)
flip-grad@S[:H][xN]   host H's rows of step S's batch are corrupted (integers XOR 1, floats x 1000)
                      as it feeds them: its local gradient is wrong before the reduction, and the
                      update reaches every copy alike (a loss spike). Once (N = 1, the default),
                      or every time its node computes step S (N = 0: a bad host)
heal@S                after step S is reported, every slow-step host computes at full speed again
                      (its probe passes, and the health loop takes it back)
jitter@S[xF]          from step S on, every host's work on each step takes a random extra
                      0 to 2F (0.2) of a healthy step: healthy hosts that vary (no straggler)
stall@S[:H][xT]       after step S, host H stops for T (5) seconds once: a pause, not a straggler
slow-step@S[:H][xF]   from step S on, host H's work on each step takes F times as long (default
                      3): a slow host, the slowness its own, not its input's; it follows the
                      node (a group without it runs at full speed), on any cluster
"""

from .callback import ChaosCallback
from .faults import ANY_CLUSTER, FLIP_BIT, KINDS, SLOW_STEP_FACTOR, ChaosInjector, ChaosSpecError, Fault, parse_chaos
from .host import HostFaults

__all__ = ["ANY_CLUSTER", "FLIP_BIT", "KINDS", "SLOW_STEP_FACTOR", "ChaosCallback", "ChaosInjector", "ChaosSpecError",
           "Fault", "HostFaults", "parse_chaos"]  # fmt: skip
