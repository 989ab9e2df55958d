"""What every Strata service imports: settings, logging, the wire protocol, bus and store helpers."""
