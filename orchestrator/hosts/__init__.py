"""The cluster as the controller sees it: what it asks of any cluster (`interface.Cluster`), the
embedded or connected Ray cluster (`cluster`), the same seen through its slices (`slices`), host
actors (`actor`) and their groups (`group`), standby actors started ahead (`standby`), and the
keepers of peer snapshots (`keepers`)."""
