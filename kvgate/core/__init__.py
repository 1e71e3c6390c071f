"""The engine core: one owner thread, typed step phases, the KV cache manager."""
