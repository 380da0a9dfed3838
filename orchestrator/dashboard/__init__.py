"""The run store and its dashboard: `store.FleetStore` keeps every job's runs, steps and events
(SQLite; `telemetry.recorder` writes them), and `server` serves the fleet and job pages over it
(`remesh dashboard`)."""
