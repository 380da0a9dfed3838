"""The fleet: several jobs sharing one Ray cluster. `scheduler` (one detached actor per cluster)
decides with `policy` how many hosts each job holds and reserves them; `cluster.FleetCluster` is a
job's link to it (its hosts, its heartbeat); `config` reads the fleet file of queues and quotas;
`simulate` replays a trace of jobs through the policy (benchmarks/fleet_trace.py). The controller
follows a grant through `control.fleet_following`, a scaling policy."""
