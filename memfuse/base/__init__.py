"""The ground floor: configuration, counters and logging, kernel launching."""
