"""`remesh` on the command line (`main`), and the wiring of a job to a cluster (`run`)."""
