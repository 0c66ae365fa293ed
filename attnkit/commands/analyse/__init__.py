"""inspect, kvmem, eval and probe: read a checkpoint or run it, write nothing."""
