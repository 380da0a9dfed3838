"""Whether two commits choose and price the same plans: for every benchmark model (8 H100s), one
JSON line with the chosen tactic, mesh, predicted collective bytes, both predicted peaks and the
predicted step time.

    .venv/bin/python benchmarks/compare_plans.py ROOT > a.log   # then diff two ROOTs' logs
"""

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, sys.argv[1])
    from examples.targets import TARGETS
    from partitioner.search import search

    for name, make in TARGETS.items():
        step, args = make()
        plan, _ = search(step, *args, devices=8, hardware="h100")
        print(
            json.dumps(
                [
                    name,
                    plan.notes[0].split()[1],
                    plan.mesh,
                    dict(plan.cost.collective_bytes),
                    plan.cost.peak_bytes_per_device,
                    plan.cost.cpu_peak_bytes_per_device,
                    round(plan.cost.total_seconds, 6),
                ]
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
