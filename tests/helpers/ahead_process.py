"""A process whose segment compiles a smaller plan ahead, with the persistent compilation cache on:
`python -m tests.helpers.ahead_process CACHE_DIR WORK_DIR`. A segment of 10 steps on 8 fake devices
compiles the 4-device plan beside training; prints the names of the programs it handed over (JSON).
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(cache: str, work: str) -> None:
    import dataclasses
    import json
    import pathlib
    import threading

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from orchestrator.worker import run_segment
    from tests.helpers.segments import spec

    work = pathlib.Path(work)
    small = spec(work, 4, 12)
    asked = iter([small.plan_json])
    reports, handed = [], threading.Event()

    def report(r):
        r = r.to_dict()
        reports.append(r)
        if r["kind"] == "compile_ahead":
            handed.set()

    big = dataclasses.replace(spec(work, 8, 10), compilation_cache=cache)
    run_segment(big, report, ahead=lambda: next(asked, None))
    if not handed.wait(timeout=600):
        raise SystemExit("compile-ahead never reported")
    ahead = next(r for r in reports if r["kind"] == "compile_ahead")
    if "error" in ahead:
        raise SystemExit(ahead["error"])
    print(json.dumps(sorted(k for k in ahead["executables"] if k != "plan")))


if __name__ == "__main__":
    main(*sys.argv[1:])
