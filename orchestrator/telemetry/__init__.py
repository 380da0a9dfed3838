"""What watches a job: the goodput ledger, the run summary, the fleet recorder, Ray's metrics and
the terminal."""
