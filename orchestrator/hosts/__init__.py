"""The cluster as the controller sees it: host actors and their groups (`group`), the embedded
or connected Ray cluster (`cluster`), and the keepers of peer snapshots (`keepers`)."""
