"""The fleet: a store of every job's runs, steps and events, and the dashboard that shows them."""
