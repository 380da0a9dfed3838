"""What a user hands remesh and what remesh asks of it: the job file (`jobfile`), the program
contract (`program`), the program's data as each host reads it (`data`) and the digest that every
state must allow (`digest`). Imports nothing else of orchestrator."""
