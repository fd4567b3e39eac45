"""The bottom layer: agreement between ranks, argument checks, byte counters, waits, closing and
leftover checks. It imports nothing from the rest of hsgd."""
