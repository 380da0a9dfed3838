"""Fault injection for tests, the demo and the fault storm; not part of the public API."""
