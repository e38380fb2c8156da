"""Pure routing logic: fleet state, scheduler, admission, role control. No I/O, injected clock."""
