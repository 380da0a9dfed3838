"""The job controller: a state machine that executes the decisions of its policies."""
