"""Plain types that cross stages: the frozen config, the request and its sampling params, outputs and stats."""
