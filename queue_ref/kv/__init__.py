"""The LevelDB-style KV queue (seed 000) over an ordered key-value interface."""
